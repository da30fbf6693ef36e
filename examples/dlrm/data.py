"""Training data for the DLRM example: synthetic Criteo-like batches or real Criteo files.

Every source yields ``torchrec.datasets.utils.Batch`` (13 dense features, 26 sparse features
``cat_0 .. cat_25``, float labels) for *this* rank, and can start at any global batch index,
which is how a resumed run continues exactly where the interrupted one stopped:

- ``synthetic``: ids from the Zipf samplers of ``torchrec_hybrid.stats.synthetic`` (same
  table sizes, permutations and multi-hot sizes as the statistics tools use); dense features
  and labels are added here. Batch ``i`` of rank ``r`` is generated from its own seed
  ``(seed, i, r)``, so batches can be produced from any position without replaying the
  stream. Labels come from a hidden ground-truth model: a fixed random logistic model over
  the standardised dense features plus a per-row random effect of a few sparse features
  (a hash of the id, so no table is stored), so AUC can rise well above 0.5. Every
  step is vectorised over the batch (loops run over the 26 features, never over samples).
- ``criteo_tsv``: Criteo TSV files (Kaggle ``train.txt`` or 1TB ``day_N``) through
  ``torchrec.datasets.criteo.criteo_terabyte``; each global batch of ``world * batch_size``
  lines is split into contiguous per-rank slices.
- ``criteo_npy``: the preprocessed ``day_N_{dense,sparse,labels}.npy`` files written by
  ``BinaryCriteoUtils.tsv_to_npys``, through ``InMemoryBinaryCriteoIterDataPipe`` (rank-aware,
  memory-mapped, ids reduced modulo the table sizes).

``torchrec_hybrid.stats.sources`` reads the same two formats for the statistics CLI, but
yields sparse features only and reads as a single process, so the readers here build full
``Batch`` objects per rank instead (the .npy file discovery is shared).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    InMemoryBinaryCriteoIterDataPipe,
    criteo_terabyte,
)
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.stats.sources import _day_key
from torchrec_hybrid.stats.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_TERABYTE_CARDINALITIES,
    DLRMV2_MULTI_HOT_SIZES,
    SyntheticCriteo,
    ZipfSampler,
    criteo_table_sizes,
    criteo_tables,
)

CARDINALITIES = {"kaggle": CRITEO_KAGGLE_CARDINALITIES, "terabyte": CRITEO_TERABYTE_CARDINALITIES}


def table_sizes_from_config(data_cfg) -> List[int]:
    cards = data_cfg.cardinalities
    cards = CARDINALITIES[cards] if isinstance(cards, str) else list(cards)
    if len(cards) != CAT_FEATURE_COUNT:
        raise ValueError(f"need {CAT_FEATURE_COUNT} cardinalities, got {len(cards)}")
    return criteo_table_sizes(cards, scale=float(data_cfg.scale), max_rows=data_cfg.max_rows)


def _seed_for(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _hash_uniform(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """A fixed pseudo-random value in [0, 1) per id (splitmix64-style mixing, wrapping int64)."""
    x = ids.to(torch.int64) * -7046029254386353131 + salt  # 0x9E3779B97F4A7C15 as int64
    x = (x ^ (x >> 31)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 29)) * -7723592293110705685  # 0x94D049BB133111EB
    x = x ^ (x >> 32)
    return (x & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)


class SyntheticCriteoBatches:
    """Criteo-like synthetic batches with labels from a hidden logistic model.

    Args:
        table_sizes: rows per sparse feature (26).
        batch_size: samples per rank per batch.
        rank, world_size: this rank's place; rank r's part of global batch i is its own draw.
        alpha: Zipf exponent of the ids.
        multi_hot: False (one id per feature), True (MLPerf DLRMv2 sizes) or 26 sizes.
        seed: seeds the samplers' permutations, the hidden model and every batch.
        base_ctr: click rate the label bias aims at (about 0.25, like Criteo).
        dense_weight_std: std of the dense part of the hidden logit.
        effect_features: sparse features whose rows carry a random effect on the logit.
        effect_std: std of each such effect (uniform, per row; a bag averages its rows).
        drift, drift_rows, drift_mode: popularity drift, as ``SyntheticCriteo``'s options: before
            global batch i each table's rank -> id map is rotated by ``floor(i * rate)`` ranks
            (``rate = drift * rows`` or ``drift_rows``); "rise": ids climb into the head,
            "burst": unseen ids appear at the top. 0 gives the batches of a stream without it.
    """

    def __init__(self, table_sizes: Sequence[int], batch_size: int, rank: int = 0, world_size: int = 1,
                 alpha: float = 1.1, multi_hot=False, seed: int = 0, base_ctr: float = 0.25,
                 dense_weight_std: float = 1.0, effect_features: Sequence[str] = (),
                 effect_std: float = 0.7, drift: float = 0.0, drift_rows: float = 0.0,
                 drift_mode: str = "rise") -> None:
        self.table_sizes = list(table_sizes)
        self.feature_names = DEFAULT_CAT_NAMES[: len(self.table_sizes)]
        if multi_hot is True:
            multi_hot = DLRMV2_MULTI_HOT_SIZES
        self.hotness = list(multi_hot)[: len(self.table_sizes)] if multi_hot else [1] * len(self.table_sizes)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed = seed
        g = torch.Generator().manual_seed(seed)  # identical on every rank
        self.samplers = [ZipfSampler(n, alpha, g) for n in self.table_sizes]
        # Dense features: log1p of log-normal "counts"; the hidden model sees them standardised.
        self.dense_mu = torch.rand(INT_FEATURE_COUNT, generator=g, dtype=torch.float64) * 3.0
        self.dense_sigma = 0.5 + torch.rand(INT_FEATURE_COUNT, generator=g, dtype=torch.float64)
        w = torch.randn(INT_FEATURE_COUNT, generator=g, dtype=torch.float64)
        self.dense_w = w / w.norm() * dense_weight_std
        unknown = [f for f in effect_features if f not in self.feature_names]
        if unknown:
            raise ValueError(f"unknown effect features {unknown}")
        self.effects = [(self.feature_names.index(f), int(torch.randint(1 << 40, (1,), generator=g)))
                        for f in effect_features]
        self.effect_std = effect_std
        # Aim the mean click rate at base_ctr: E[sigmoid(N(m, v))] ~ sigmoid(m / sqrt(1 + pi v / 8)).
        var = dense_weight_std ** 2 + len(self.effects) * effect_std ** 2
        self.bias = math.log(base_ctr / (1 - base_ctr)) * math.sqrt(1 + math.pi * var / 8)
        self.lengths = torch.cat([torch.full((batch_size,), h, dtype=torch.int32) for h in self.hotness])
        # drift: the statistics tools' generator (same seed, so the same permutations) checks
        # the options and gives the rotation of each table's ranking at a batch, and top_ids
        self.drift = SyntheticCriteo(self.table_sizes, batch_size, 1, alpha=alpha, multi_hot=multi_hot,
                                     seed=seed, drift=drift, drift_rows=drift_rows, drift_mode=drift_mode)
        self.drifting = bool(drift or drift_rows)

    def shifts(self, index: int) -> List[int]:
        """Per table, the signed rotation of its ranking at global batch ``index`` (0: none)."""
        if not self.drifting:
            return [0] * len(self.table_sizes)
        sign = 1 if self.drift.drift_mode == "rise" else -1
        return [sign * s for s in self.drift.rank_shifts(index)]

    def top_ids(self, index: int, k: int):
        """Per feature, its k most popular ids at global batch ``index`` (hottest first)."""
        return self.drift.top_ids(index, k)

    @property
    def num_batches(self) -> Optional[int]:
        return None  # endless

    def batch(self, index: int) -> Batch:
        """This rank's part of global batch ``index``."""
        b = self.batch_size
        g = torch.Generator().manual_seed(_seed_for(self.seed, index, self.rank, self.world_size))
        ids = [s.sample(b * h, g, shift) for s, h, shift in zip(self.samplers, self.hotness, self.shifts(index))]
        z = torch.randn(b, INT_FEATURE_COUNT, generator=g, dtype=torch.float64)
        counts = torch.floor(torch.exp(self.dense_mu + self.dense_sigma * z))
        dense = torch.log1p(counts)
        logit = self.bias + z @ self.dense_w  # z is the standardised log-count
        for f, salt in self.effects:
            u = _hash_uniform(ids[f], salt).view(b, self.hotness[f]).mean(1)
            logit = logit + (2.0 * u - 1.0) * (math.sqrt(3.0) * self.effect_std)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        sparse = KeyedJaggedTensor(keys=self.feature_names, values=torch.cat(ids), lengths=self.lengths,
                                   stride=b)
        return Batch(dense_features=dense.float(), sparse_features=sparse, labels=labels.float())

    def batches(self, start: int = 0) -> Iterator[Batch]:
        for i in itertools.count(start):
            yield self.batch(i)


_TSV_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT


def _tsv_row_problem(row: List[str]) -> Optional[str]:
    """What is wrong with one Criteo TSV line (the error path's search; None: nothing)."""
    if len(row) != _TSV_COLUMNS:
        return f"{len(row)} columns, not {_TSV_COLUMNS}"
    for j, v in enumerate(row):
        try:
            x = (int(v, 16) if j > INT_FEATURE_COUNT else int(v)) if v else 0
        except ValueError:
            kind = "a hexadecimal id" if j > INT_FEATURE_COUNT else "an integer"
            return f"column {j + 1} is {v!r}, not {kind}"
        if j == 0 and x not in (0, 1):
            return f"label {v!r}, not 0 or 1"
    return None


def _rows_to_batch(rows: List[List[str]], table_sizes: np.ndarray, first_line: int = 1, where: str = "") -> Batch:
    """Criteo TSV rows (label, 13 ints, 26 hex) -> Batch; dense = log(1 + max(x, 0)). A bad line
    raises ValueError naming it (``first_line``: the number of the first row; ``where``: the files)."""
    try:
        arr = np.asarray(rows, dtype=object)
        if arr.ndim != 2 or arr.shape[1] != _TSV_COLUMNS:
            raise ValueError("ragged")
        ints = np.vectorize(lambda v: int(v) if v else 0, otypes=[np.int64])(arr[:, : 1 + INT_FEATURE_COUNT])
        cats = np.vectorize(lambda v: int(v, 16) if v else 0, otypes=[np.int64])(arr[:, 1 + INT_FEATURE_COUNT:])
        if not np.isin(ints[:, 0], (0, 1)).all():
            raise ValueError("label")
    except ValueError:  # find the line (a loop over the rows, on the error path only)
        bad = next(((i, p) for i, r in enumerate(rows) for p in [_tsv_row_problem(r)] if p), (0, "unreadable"))
        raise ValueError(f"{where}Criteo TSV line {first_line + bad[0]}: {bad[1]}") from None
    return _arrays_to_batch(np.log1p(np.maximum(ints[:, 1:], 0)).astype(np.float32),
                            cats % table_sizes, ints[:, 0].astype(np.float32))


def _arrays_to_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
    b = sparse.shape[0]
    kjt = KeyedJaggedTensor(keys=DEFAULT_CAT_NAMES,
                            values=torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1)),
                            lengths=torch.ones(b * CAT_FEATURE_COUNT, dtype=torch.int32), stride=b)
    return Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt,
                 labels=torch.from_numpy(labels.reshape(-1)).float())


class CriteoTSVBatches:
    """Criteo TSV files; global batch i = lines [i*W*B, (i+1)*W*B), rank r takes its B lines.

    A trailing partial global batch is dropped (every rank must run the same steps).
    """

    def __init__(self, paths: Sequence[str], table_sizes: Sequence[int], batch_size: int,
                 rank: int = 0, world_size: int = 1) -> None:
        if not paths:
            raise ValueError("data.paths: no Criteo TSV files given")
        self.paths = list(paths)
        self.table_sizes = np.asarray(table_sizes, dtype=np.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size

    @property
    def num_batches(self) -> Optional[int]:
        return None  # unknown until read; the stream just ends

    def batches(self, start: int = 0) -> Iterator[Batch]:
        per_global = self.batch_size * self.world_size
        lines = criteo_terabyte(self.paths, row_mapper=None)
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        lines = itertools.islice(lines, start * per_global, None)  # skip without parsing
        where = f"data.paths {self.paths}: "
        for i in itertools.count(start):
            chunk = list(itertools.islice(lines, per_global))
            if len(chunk) < per_global:
                return
            # line numbers count from 1 over the files one after another
            yield _rows_to_batch(chunk[lo:hi], self.table_sizes, i * per_global + lo + 1, where)


def npy_day_stems(directory: str) -> List[str]:
    sparse = sorted(glob.glob(os.path.join(directory, "*_sparse.npy")), key=_day_key)
    if not sparse:
        raise FileNotFoundError(f"no *_sparse.npy files in {directory}")
    return [p[: -len("_sparse.npy")] for p in sparse]


class CriteoNpyBatches:
    """Preprocessed Criteo .npy days in a directory, this rank's share (drop_last)."""

    def __init__(self, directory: str, table_sizes: Sequence[int], batch_size: int,
                 rank: int = 0, world_size: int = 1) -> None:
        stems = npy_day_stems(directory)
        self.pipe = InMemoryBinaryCriteoIterDataPipe(
            stage="train", dense_paths=[s + "_dense.npy" for s in stems],
            sparse_paths=[s + "_sparse.npy" for s in stems], labels_paths=[s + "_labels.npy" for s in stems],
            batch_size=batch_size, rank=rank, world_size=world_size, drop_last=True, mmap_mode=True,
            hashes=list(table_sizes),
        )

    @property
    def num_batches(self) -> Optional[int]:
        return len(self.pipe)

    def batches(self, start: int = 0) -> Iterator[Batch]:
        for b in itertools.islice(iter(self.pipe), start, None):
            yield Batch(dense_features=b.dense_features.float(), sparse_features=b.sparse_features,
                        labels=b.labels.float())


# synthetic held-out batches: indices no training run reaches (batch i has its own seed)
VALIDATION_OFFSET = 1 << 40


def build_validation(cfg, rank: int, world_size: int):
    """Held-out batches for the validation pass, or None when the config names none.

    synthetic: the same generator at indices from ``VALIDATION_OFFSET`` (never trained on);
    criteo_tsv / criteo_npy: ``data.validation_paths`` / ``data.validation_dir``.
    Returns a callable giving a fresh iterator (every pass sees the same batches).
    """
    d = cfg.data
    if d.source == "synthetic":
        src, _ = build_data(cfg, rank, world_size)
        return lambda: src.batches(VALIDATION_OFFSET)
    sizes = table_sizes_from_config(d)
    if d.source == "criteo_tsv" and d.validation_paths:
        tsv = CriteoTSVBatches(d.validation_paths, sizes, d.batch_size, rank, world_size)
        return lambda: tsv.batches(0)
    if d.source == "criteo_npy" and d.validation_dir:
        npy = CriteoNpyBatches(d.validation_dir, sizes, d.batch_size, rank, world_size)
        return lambda: npy.batches(0)
    return None


def build_data(cfg, rank: int, world_size: int):
    """(source, tables) for the config's ``data`` section; tables are ``t_cat_i`` configs."""
    d = cfg.data
    sizes = table_sizes_from_config(d)
    pooling = PoolingType[str(cfg.model.pooling).upper()]
    tables: List[EmbeddingBagConfig] = [dataclasses.replace(t, pooling=pooling)
                                        for t in criteo_tables(sizes, embedding_dim=cfg.model.embedding_dim)]
    if d.source == "synthetic":
        lab = d.label
        src = SyntheticCriteoBatches(sizes, d.batch_size, rank, world_size, alpha=d.alpha,
                                     multi_hot=d.multi_hot, seed=cfg.seed, base_ctr=lab.base_ctr,
                                     dense_weight_std=lab.dense_weight_std,
                                     effect_features=lab.effect_features, effect_std=lab.effect_std,
                                     drift=d.drift, drift_rows=d.drift_rows, drift_mode=d.drift_mode)
    elif d.source == "criteo_tsv":
        src = CriteoTSVBatches(d.paths, sizes, d.batch_size, rank, world_size)
    elif d.source == "criteo_npy":
        src = CriteoNpyBatches(d.dir, sizes, d.batch_size, rank, world_size)
    else:
        raise ValueError(f"data.source must be synthetic, criteo_tsv or criteo_npy, got {d.source!r}")
    return src, tables
