"""A seeded, Criteo-like synthetic stream of KeyedJaggedTensors.

No real Criteo data can be downloaded here, so statistics, planner and benchmarks run on a
stand-in with the same shape: 26 sparse features ``cat_0 .. cat_25`` with the Criteo
cardinalities (scaled and capped), ids drawn from a Zipf(alpha) law over ranks, each rank
mapped to an id by a fixed random permutation of the table (so hot rows are scattered, as
after hashing), one id per feature or the MLPerf DLRMv2 multi-hot sizes.

Sampling is exact inverse-CDF over the table's ranks (``searchsorted`` over a float64 CDF),
vectorised per feature; it holds 16 bytes per table row (CDF + permutation).

Drift (``drift`` or ``drift_rows``): popularity moves over time. Before batch ``b`` the
rank -> id map of a table of ``n`` rows is rotated by ``s_b = floor(b * rate)`` positions,
``rate = drift * n`` (a share of the ranking per batch) or ``drift_rows`` (rows per batch).
``drift_mode="rise"`` (default): the id at rank ``r`` is the one that had rank ``r + s_b``
(mod n) at batch 0, so every id climbs ``rate`` ranks per batch, new ids enter the head
from the warm ranks below it and the hottest ones leave for the cold tail.
``drift_mode="burst"``: the id at rank ``r`` had rank ``r - s_b`` (mod n): each batch about
``rate`` of the coldest (unseen) ids appear at the very top and everyone else moves down,
like news that is hottest when new. Either way the ``k`` most popular rows are all replaced
after ``k / rate`` batches (half of them after ``k / (2 rate)``). It costs one add and one
remainder per sampled id, is deterministic (the seed fixes the permutation, the batch index
the rotation) and with no drift gives exactly the batches of a stream without it.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

CRITEO_KAGGLE_CARDINALITIES: List[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# Criteo 1TB with the MLPerf 40M cap, as in TorchRec's DLRM example.
CRITEO_TERABYTE_CARDINALITIES: List[int] = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282,
    10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]
DLRMV2_MULTI_HOT_SIZES: List[int] = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
]
CAT_NAMES: List[str] = [f"cat_{i}" for i in range(26)]


def _is_count(x: object, lo: int) -> bool:
    """An integer (Python or NumPy, not bool) >= lo."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= lo


def _is_real(x: object, lo: float, strict: bool = False) -> bool:
    """A finite real number >= lo (> lo with strict)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(float(x)):
        return False
    return float(x) > lo if strict else float(x) >= lo


def criteo_table_sizes(
    cardinalities: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES,
    scale: float = 1.0,
    max_rows: Optional[int] = None,
) -> List[int]:
    """Cardinalities times `scale` (rounded up, at least 1), capped at `max_rows` (None: no cap)."""
    if not _is_real(scale, 0, strict=True):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if max_rows is not None and not _is_count(max_rows, 1):
        raise ValueError(f"max_rows must be an int >= 1 (None: no cap), got {max_rows!r}")
    sizes = [max(1, math.ceil(c * scale)) for c in cardinalities]
    return [min(s, max_rows) for s in sizes] if max_rows is not None else sizes


def criteo_tables(
    sizes: Sequence[int], embedding_dim: int = 128, feature_names: Sequence[str] = CAT_NAMES
) -> List[EmbeddingBagConfig]:
    """One table ``t_<feature>`` per feature."""
    return [
        EmbeddingBagConfig(num_embeddings=n, embedding_dim=embedding_dim,
                           name=f"t_{f}", feature_names=[f])
        for n, f in zip(sizes, feature_names)
    ]


class ZipfSampler:
    """Ids of one table: rank r (0-based) has probability ~ (r + 1) ** -alpha.

    ``sorted_ids``: id = popularity rank (id 0 the hottest), as NVIDIA's Criteo preprocessing
    numbers categories; else a fixed random permutation of the ranks.
    """

    def __init__(self, num_rows: int, alpha: float, generator: torch.Generator, sorted_ids: bool = False) -> None:
        weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-alpha)
        self.cdf = torch.cumsum(weights, 0)
        self.cdf /= self.cdf[-1].clone()
        perm = torch.randperm(num_rows, generator=generator)  # drawn either way: same stream after
        self.perm = torch.arange(num_rows) if sorted_ids else perm

    def sample(self, n: int, generator: torch.Generator, shift: int = 0) -> torch.Tensor:
        """n ids; with ``shift`` the rank -> id map is rotated (see module docstring)."""
        u = torch.rand(n, dtype=torch.float64, generator=generator)
        ranks = torch.searchsorted(self.cdf, u).clamp_(max=self.perm.numel() - 1)
        return self.perm[self._rotate(ranks, shift)]

    def _rotate(self, ranks: torch.Tensor, shift: int) -> torch.Tensor:
        """Rank now -> rank at batch 0 (``shift`` signed: > 0 ids rise, < 0 newcomers burst in)."""
        return ranks.add_(shift).remainder_(self.perm.numel()) if shift else ranks

    def top_ids(self, k: int, shift: int = 0) -> torch.Tensor:
        """The ids of ranks 0..k-1 (the k most popular, hottest first) under ``shift``."""
        k = min(k, self.perm.numel())
        return self.perm[self._rotate(torch.arange(k), shift)]


class SyntheticCriteo:
    """Re-iterable stream of `num_batches` KJTs of `batch_size` samples (same data each pass).

    Args:
        table_sizes: rows per feature (see criteo_table_sizes).
        multi_hot: False for one id per feature, True for the DLRMv2 sizes, or a list.
        sorted_ids: ids numbered by popularity (see :class:`ZipfSampler`).
        drift: share of each table's popularity ranking rotated per batch (0: none), e.g.
            1e-4: every 10,000 batches the whole ranking has turned over once (see the
            module docstring).
        drift_rows: alternatively, ranks rotated per batch in every table (a float: 0.5 is
            one rank every second batch), e.g. 1.0 replaces half of the 2,000 most popular
            rows of each (large enough) table every 1,000 batches.
        drift_mode: "rise" (ids climb into the head from below, the head leaves for the
            tail) or "burst" (unseen ids appear at the top, the rest move down).
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        batch_size: int,
        num_batches: int,
        alpha: float = 1.1,
        multi_hot: Union[bool, Sequence[int]] = False,
        seed: int = 0,
        feature_names: Sequence[str] = CAT_NAMES,
        sorted_ids: bool = False,
        drift: float = 0.0,
        drift_rows: float = 0.0,
        drift_mode: str = "rise",
    ) -> None:
        for what, v, lo in (("batch_size", batch_size, 1), ("num_batches", num_batches, 1)):
            if not _is_count(v, lo):
                raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
        if not _is_real(alpha, 0):
            raise ValueError(f"alpha (the Zipf exponent) must be a finite number >= 0 (0: uniform), got {alpha!r}")
        bad_sizes = [(i, n) for i, n in enumerate(table_sizes) if not _is_count(n, 1)]
        if bad_sizes:
            raise ValueError(f"table sizes must be ints >= 1, got (index, size) {bad_sizes[:5]}")
        if not _is_real(drift, 0) or drift > 1:
            raise ValueError(f"drift (share of the ranking rotated per batch) must be in [0, 1], got {drift!r}")
        if not _is_real(drift_rows, 0):
            raise ValueError(f"drift_rows (ranks rotated per batch) must be a finite number >= 0, got {drift_rows!r}")
        if drift and drift_rows:
            raise ValueError("give drift (a share of each table) or drift_rows (rows), not both")
        if drift_mode not in ("rise", "burst"):
            raise ValueError(f"drift_mode must be 'rise' or 'burst', got {drift_mode!r}")
        self.drift, self.drift_rows, self.drift_mode = float(drift), float(drift_rows), drift_mode
        self.sorted_ids = sorted_ids
        self.table_sizes = list(table_sizes)
        n = len(self.table_sizes)
        if len(feature_names) < n:
            raise ValueError(f"{n} tables need {n} feature names, got {len(feature_names)} (the default names "
                             f"the {len(CAT_NAMES)} Criteo features: pass feature_names for more tables)")
        self.feature_names = list(feature_names)[:n]
        if multi_hot is True:
            multi_hot = DLRMV2_MULTI_HOT_SIZES
        if multi_hot:  # False or empty: one id per bag
            hot = list(multi_hot)
            if len(hot) < n or any(not _is_count(h, 0) for h in hot[:n]):
                raise ValueError(f"multi_hot needs an int >= 0 (ids per bag) for each of the {n} tables, got "
                                 f"{hot[:n + 1]!r}")
        self.hotness = list(multi_hot)[:n] if multi_hot else [1] * n
        self.batch_size, self.num_batches = batch_size, num_batches
        self.alpha, self.seed = alpha, seed
        self._samplers: Optional[List[ZipfSampler]] = None

    def __len__(self) -> int:
        return self.num_batches

    def _get_samplers(self) -> List[ZipfSampler]:
        if self._samplers is None:  # permutations depend on the seed only
            g = torch.Generator().manual_seed(self.seed)
            self._samplers = [ZipfSampler(n, self.alpha, g, self.sorted_ids) for n in self.table_sizes]
        return self._samplers

    def rank_shifts(self, batch: int) -> List[int]:
        """Per table, how far its popularity ranking has rotated before batch ``batch``."""
        return [int(math.floor(batch * (self.drift * n if self.drift else self.drift_rows))) % n
                for n in self.table_sizes]

    def _signed_shifts(self, batch: int) -> List[int]:
        sign = 1 if self.drift_mode == "rise" else -1
        return [sign * s for s in self.rank_shifts(batch)]

    def top_ids(self, batch: int, k: int) -> Dict[str, torch.Tensor]:
        """Per feature, the ids of its k most popular rows (hottest first) at batch ``batch``.

        What a hot set planned on perfect statistics of that batch holds (the drift
        scenario's ideal).
        """
        return {f: s.top_ids(k, shift) for f, s, shift in
                zip(self.feature_names, self._get_samplers(), self._signed_shifts(batch))}

    def __iter__(self) -> Iterator[KeyedJaggedTensor]:
        samplers = self._get_samplers()
        g = torch.Generator().manual_seed(self.seed + 1)
        b = self.batch_size
        lengths = torch.cat([torch.full((b,), h, dtype=torch.int32) for h in self.hotness])
        drifting = bool(self.drift or self.drift_rows)
        for i in range(self.num_batches):
            shifts = self._signed_shifts(i) if drifting else [0] * len(samplers)
            values = torch.cat([s.sample(b * h, g, shift)
                                for s, h, shift in zip(samplers, self.hotness, shifts)])
            yield KeyedJaggedTensor(keys=self.feature_names, values=values,
                                    lengths=lengths, stride=b)
