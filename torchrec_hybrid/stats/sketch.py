"""Bounded-memory heavy-hitter sketch for tables too large to count exactly.

`CountMinTopK` is a Count-Min sketch plus a candidate set of the (estimated) most
frequent ids. Both are updated once per batch with vectorised tensor ops, so the cost
per id is a few multiplies, one `scatter_add_` and one gather per sketch row.

Error bound (Cormode & Muthukrishnan, 2005). With width ``w = ceil(e / eps)`` (rounded up
to a power of two here) and depth ``d = ceil(ln(1 / delta))``, for every id ``x`` after a
stream of ``N`` lookups::

    count(x) <= estimate(x) <= count(x) + eps * N     with probability >= 1 - delta

The estimate never undercounts. The bound needs the row hashes to be pairwise
independent: we use Dietzfelbinger's multiply-add-shift hash
``h(x) = ((a * x + b) mod 2**64) >> (64 - log2(w))`` with random 64-bit ``a, b``, which is
2-independent for keys below ``2**32`` (tables up to 4.29e9 rows).

Candidates: every id whose estimate beats the smallest estimate of a full candidate set
is admitted (through a small pending buffer); the set keeps the ``capacity`` ids with the
largest estimates (ties: smaller id first). An id whose estimate exceeds the
``capacity``-th largest estimate at the time it is looked up is therefore kept, which for
skewed (Zipf) data recovers the heavy hitters with high recall (see tests).

Decay: ``decay_(f)`` multiplies every counter and candidate estimate by ``f`` (counters turn
float64 on the first decay). Scaling is linear and monotone, so the bound above holds for
the decayed counts ``sum_i f**(age_i)`` with ``N`` the decayed number of lookups, and the
candidates' order is unchanged. ``update(ids, weight)`` adds ``weight`` per lookup, which
`FrequencyStats` uses to decay lazily (one scale factor, folded in on read).

Memory between updates is bounded by ``memory_bound_bytes()``: ``8 * d * w`` (int64
counters) + ``16 * capacity`` (candidate ids and estimates) + ``8 * next_pow2(4 * capacity)``
(membership slots) + ``8 * capacity`` (pending ids) + hash parameters. Temporaries
inside one update (a few ints per id of the batch) are not counted.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

MAX_KEY = 1 << 32  # keys must be below this for the hash to be 2-independent
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (Fibonacci hashing)


def sketch_shape(eps: float, delta: float) -> Tuple[int, int]:
    """(depth, width) for an eps/delta Count-Min guarantee; width is a power of two."""
    if not (0 < eps < 1 and 0 < delta < 1):
        raise ValueError(f"need 0 < eps, delta < 1, got eps={eps}, delta={delta}")
    width = 1 << max(1, math.ceil(math.log2(math.e / eps)))
    depth = max(1, math.ceil(math.log(1.0 / delta)))
    return depth, width


def table_seed(seed: int, name: str) -> int:
    """The hash seed of table ``name``'s sketch in statistics seeded ``seed`` (each table hashes apart)."""
    return seed + zlib.crc32(name.encode())


def top_by_count(ids: torch.Tensor, counts: torch.Tensor, k: Optional[int] = None):
    """Sort (ids, counts) by count descending, ties by smaller id; keep the first k.

    ``ids`` must be sorted ascending on entry: the stable sort then breaks ties by id.
    """
    order = torch.sort(counts, descending=True, stable=True).indices
    if k is not None:
        order = order[:k]
    return ids[order], counts[order]


class CountMinTopK:
    """Count-Min sketch + candidate top-k set for one table (see module docstring)."""

    def __init__(
        self,
        num_embeddings: int,
        capacity: int,
        eps: float = 1e-5,
        delta: float = 0.05,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_embeddings > MAX_KEY:
            raise ValueError(f"sketch supports tables below {MAX_KEY} rows, got {num_embeddings}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_embeddings = num_embeddings
        self.capacity = capacity
        self.eps, self.delta, self.seed = eps, delta, seed
        self.device = torch.device(device)
        self.depth, self.width = sketch_shape(eps, delta)
        self._shift = 64 - int(math.log2(self.width))
        g = torch.Generator().manual_seed(seed)
        # a must be odd; int64 arithmetic wraps mod 2**64 as the hash requires.
        a = torch.randint(-(1 << 62), 1 << 62, (self.depth, 1), generator=g) * 2 + 1
        b = torch.randint(-(1 << 62), 1 << 62, (self.depth, 1), generator=g)
        self.hash_a, self.hash_b = a.to(self.device), b.to(self.device)
        self._row_offset = (torch.arange(self.depth) * self.width).view(-1, 1).to(self.device)
        self.table = torch.zeros(self.depth * self.width, dtype=torch.int64, device=self.device)
        self.cand_ids = torch.empty(0, dtype=torch.int64, device=self.device)
        self.cand_est = torch.empty(0, dtype=torch.int64, device=self.device)
        # direct-mapped candidate membership table (4 slots per candidate) + pending ids
        num_slots = 1 << max(2, math.ceil(math.log2(4 * capacity)))
        self._slot_shift = 64 - int(math.log2(num_slots))
        self._slots = torch.full((num_slots,), -1, dtype=torch.int64, device=self.device)
        self._pending: List[torch.Tensor] = []
        self._num_pending = 0
        self._max_pending = capacity

    # -- hashing / queries -------------------------------------------------------------
    def _cells(self, ids: torch.Tensor) -> torch.Tensor:
        """Flat cell index of each id in each row: shape [depth, n]."""
        h = self.hash_a * ids.view(1, -1)  # in place from here: saves allocations
        h.add_(self.hash_b).bitwise_right_shift_(self._shift).bitwise_and_(self.width - 1)
        return h.add_(self._row_offset)

    def _min_over_rows(self, cells: torch.Tensor) -> torch.Tensor:
        # index_select + a loop of torch.minimum: several times faster than amin(0) here.
        vals = self.table.index_select(0, cells.reshape(-1)).view(self.depth, -1)
        est = vals[0]
        for r in range(1, self.depth):
            est = torch.minimum(est, vals[r])
        return est

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Count-Min estimate (an overestimate) of each id's count (the counters' dtype)."""
        ids = ids.to(self.device, torch.int64).view(-1)
        if ids.numel() == 0:
            return torch.empty(0, dtype=self.table.dtype, device=self.device)
        return self._min_over_rows(self._cells(ids))

    def _slot(self, ids: torch.Tensor) -> torch.Tensor:
        return ((ids * _GOLDEN) >> self._slot_shift) & (self._slots.numel() - 1)

    # -- updates -----------------------------------------------------------------------
    def update(self, ids: torch.Tensor, weight: float = 1) -> None:
        """Count one batch of (already validated) ids, adding ``weight`` per lookup.

        A weight other than 1 needs float counters (see `to_float_`, `decay_`).

        Ids whose estimate beats the smallest candidate estimate and that are not known
        candidates go to a pending buffer; the candidate set is recomputed from
        candidates + pending once the buffer holds `capacity` ids (or on any read).
        The membership test is a direct-mapped table of the candidates: it can only miss
        (a known candidate goes to pending again: extra work and an earlier flush); it
        never drops an id that is not a candidate.
        """
        ids = ids.to(self.device, torch.int64).view(-1)
        if ids.numel() == 0:
            return
        if weight != 1 and not self.table.is_floating_point():
            raise ValueError("a weighted update needs float counters: call to_float_() first")
        cells = self._cells(ids)
        one = torch.full((1,), weight, dtype=self.table.dtype, device=self.device)
        self.table.scatter_add_(0, cells.view(-1), one.expand(cells.numel()))
        if self.cand_ids.numel() >= self.capacity:
            ids = ids[self._min_over_rows(cells) > self.cand_est[-1]]
        ids = ids[self._slots[self._slot(ids)] != ids]
        if ids.numel():
            self._pending.append(ids)
            self._num_pending += ids.numel()
            if self._num_pending >= self._max_pending:
                self._flush()

    def _flush(self, extra: Optional[torch.Tensor] = None) -> None:
        """Union candidates, pending ids and extra; re-estimate; keep the top `capacity`."""
        parts = [self.cand_ids, *self._pending] + ([extra.to(self.device)] if extra is not None else [])
        self._pending, self._num_pending = [], 0
        ids = torch.unique(torch.cat(parts))  # sorted ascending, as top_by_count needs
        self.cand_ids, self.cand_est = top_by_count(ids, self.estimate(ids), self.capacity)
        self._fill_slots()

    def _fill_slots(self) -> None:
        # amax: deterministic winner when two candidates share a slot (also on CUDA)
        self._slots.fill_(-1)
        self._slots.scatter_reduce_(0, self._slot(self.cand_ids), self.cand_ids, reduce="amax")

    def merge_(self, other: "CountMinTopK") -> "CountMinTopK":
        """Add another sketch of the same shape and hashes (the sketch is linear)."""
        self.check_same_shape(other)
        other._flush()
        if other.table.is_floating_point():
            self.to_float_()
        self.table += other.table.to(self.device, self.table.dtype)
        self._flush(other.cand_ids)
        return self

    # -- decay -------------------------------------------------------------------------
    def to_float_(self) -> "CountMinTopK":
        """Hold counters and estimates as float64 (a no-op if they already are)."""
        if not self.table.is_floating_point():
            self.table = self.table.to(torch.float64)
            self.cand_est = self.cand_est.to(torch.float64)
        return self

    def decay_(self, factor: float) -> "CountMinTopK":
        """Multiply every count by ``factor`` in (0, 1]: old lookups fade (see module docstring)."""
        check_decay(factor)
        if factor != 1:
            self.to_float_()
            self.table.mul_(factor)
            self.cand_est.mul_(factor)
        return self

    def _scale_estimates_(self, factor: float) -> None:
        # the table was scaled by its owner (it is a view into the owner's buffer)
        self.cand_est.mul_(factor)

    def _bind_table(self, storage: torch.Tensor) -> None:
        """Count into ``storage`` (a view of the owner's flat buffer) from now on."""
        storage.copy_(self.table)
        self.table = storage
        self.cand_est = self.cand_est.to(storage.dtype)

    def _union_candidates(self, ids: torch.Tensor) -> None:
        """Candidates := the best of ``ids`` (e.g. every rank's candidates), re-estimated."""
        self._pending, self._num_pending = [], 0
        self.cand_ids = self.cand_ids[:0]
        self._flush(ids)

    def check_same_shape(self, other: "CountMinTopK") -> None:
        mine = (self.num_embeddings, self.capacity, self.depth, self.width, self.seed)
        theirs = (other.num_embeddings, other.capacity, other.depth, other.width, other.seed)
        if mine != theirs:
            raise ValueError(
                "sketches differ in (num_embeddings, capacity, depth, width, seed): "
                f"{mine} vs {theirs}"
            )

    def all_reduce_(self, group=None) -> None:
        """Sum the tables over ranks and union the candidates; identical on every rank."""
        self._flush()
        dist.all_reduce(self.table, op=dist.ReduceOp.SUM, group=group)
        padded = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        padded[: self.cand_ids.numel()] = self.cand_ids
        world = dist.get_world_size(group)
        gathered = torch.empty(world * self.capacity, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, padded, group=group)
        self.cand_ids = self.cand_ids[:0]
        self._flush(gathered[gathered >= 0])

    # -- accounting / persistence --------------------------------------------------------
    def top(self, k: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Candidate (ids, estimates), by estimate descending then id ascending."""
        self._flush()
        keep = self.cand_est > 0
        ids, est = self.cand_ids[keep], self.cand_est[keep]
        return (ids, est) if k is None else (ids[:k], est[:k])

    def memory_bytes(self) -> int:
        """Bytes held by the sketch's tensors right now."""
        tensors = [self.table, self.cand_ids, self.cand_est, self._slots, *self._pending]
        return sum(t.numel() * t.element_size() for t in tensors) + 16 * self.depth

    def memory_bound_bytes(self) -> int:
        """Upper bound on memory_bytes() for this configuration."""
        return (8 * self.depth * self.width + 16 * self.capacity + 8 * self._slots.numel()
                + 8 * self.capacity + 16 * self.depth)

    def state_dict(self) -> Dict[str, Any]:
        self._flush()
        return {
            "num_embeddings": self.num_embeddings, "capacity": self.capacity,
            "eps": self.eps, "delta": self.delta, "seed": self.seed,
            # clone: .cpu() of a cpu tensor is the tensor itself, and a state must not alias
            "table": self.table.cpu().clone(), "cand_ids": self.cand_ids.cpu().clone(),
            "cand_est": self.cand_est.cpu().clone(),
        }

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any], device="cpu") -> "CountMinTopK":
        sk = cls(state["num_embeddings"], state["capacity"], state["eps"], state["delta"],
                 state["seed"], device=device)
        if state["table"].numel() != sk.table.numel():
            raise ValueError("sketch table size does not match its eps/delta")
        sk.table = state["table"].to(sk.device).clone()
        sk.cand_ids = state["cand_ids"].to(sk.device)
        sk.cand_est = state["cand_est"].to(sk.device)
        sk._fill_slots()
        return sk

    def load_state_(self, state: Dict[str, Any]) -> None:
        """Copy a `state_dict()` of the same shape into this sketch's existing counters."""
        mine = (self.num_embeddings, self.capacity, self.eps, self.delta, self.seed, self.table.numel())
        theirs = tuple(state[k] for k in ("num_embeddings", "capacity", "eps", "delta", "seed")) \
            + (state["table"].numel(),)
        if mine != theirs:
            raise ValueError(f"sketch state (num_embeddings, capacity, eps, delta, seed, cells) "
                             f"{theirs} does not match this sketch's {mine}")
        self.table.copy_(state["table"])
        self.cand_ids = state["cand_ids"].to(self.device)
        self.cand_est = state["cand_est"].to(self.device, self.table.dtype)
        self._pending, self._num_pending = [], 0
        self._fill_slots()


def check_decay(factor: float) -> None:
    """Raise ValueError unless ``factor`` is a number in (0, 1]."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"decay factor must be a number in (0, 1], got {factor!r}")
