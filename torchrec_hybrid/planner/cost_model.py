"""The planner's cost model: what each sharding type costs each rank per step, and what a plan costs.

One model per sharding type (:data:`MODELS`; TorchRec's two-level types priced as their family,
:data:`FAMILIES`) gives, for one table: the bytes sent per rank by collective (``parts``, the mean
over ranks) and by rank (``rank_bytes``), each rank's compute work (``rank_work``, the terms of
:data:`WORK_TERMS`) and the collectives of its sharding group (``collectives``); frequency_hybrid
also its memory and, for hot-set sizing, its cost as a function of H. A model prices a sharding
option (``rank_cost``, and per shard :func:`shard_costs`, what TorchRec's ``Perf`` carries); the
last section prices a partitioned plan in ms (:func:`plan_cost`): the busiest rank's bytes /
bandwidth + its work at fitted prices (:class:`ComputeCosts`) + a fixed cost per collective, one
unit for stock and hybrid options alike.

Bytes are what this package and TorchRec 1.8 put on the wire (fp32 unless the sharder's quantized
comms say otherwise, :class:`CommElems`; gloo ring collectives; W ranks, local batch B): bytes sent
by one rank in one step, as ``wchar`` counts them (``torchrec_hybrid.comm_bytes``; checked by
``torchrec_hybrid.validate``). docs/architecture.md §5 derives the formulas. What the sharding
decides and this model prices (row blocks, heavy owners, rooms) comes from ``row_blocks`` and
``types``, not from ``sharding/``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner.shard_estimators import get_num_poolings
from torchrec.distributed.planner.types import CollectiveType, ParameterConstraints, ShardingOption, Topology

from torchrec_hybrid import row_blocks
from torchrec_hybrid.types import FREQUENCY_HYBRID, ROOM_PAD, ROOM_SLACK

FP32 = 4
INT32 = 4
INT64 = 8

TABLE_WISE = "table_wise"
COLUMN_WISE = "column_wise"
ROW_WISE = "row_wise"
DATA_PARALLEL = "data_parallel"

A2A_COMM_OP = "POOLED_EMBEDDINGS_ALL_TO_ALL"  # TorchRec CommOp names (qcomm_codecs_registry keys)
RS_COMM_OP = "POOLED_EMBEDDINGS_REDUCE_SCATTER"

# Optimizer state bytes per row as a function of dim (fp32 state), by FBGEMM/TorchRec name.
_OPTIMIZER_STATE = {k.replace("_", ""): v for k, v in {  # keys without underscores: "RowWiseAdagrad" matches too
    "sgd": lambda d: 0, "exact_sgd": lambda d: 0,
    "rowwise_adagrad": lambda d: 4, "exact_rowwise_adagrad": lambda d: 4,
    "adagrad": lambda d: 4 * d, "exact_adagrad": lambda d: 4 * d,
    "adam": lambda d: 8 * d, "lamb": lambda d: 8 * d,
    "partial_rowwise_adam": lambda d: 4 * d + 4, "partial_rowwise_lamb": lambda d: 4 * d + 4,
}.items()}


def optimizer_state_bytes_per_row(optimizer: Optional[str], dim: int) -> int:
    """fp32 optimizer state per embedding row (unknown names: as much as the weights)."""
    if optimizer is None:
        return 0
    key = str(optimizer).lower().rsplit(".", 1)[-1].replace("_", "")  # EmbOptimType names, torch.optim classes
    fn = _OPTIMIZER_STATE.get(key)
    return fn(dim) if fn else 4 * dim


@dataclass(frozen=True)
class CommElems:
    """Bytes per element of pooled vectors on the wire, forward and backward: the pooled all-to-all
    (``a2a_*``: table_wise / column_wise outputs, the hybrid's partial sums and hot rows) and the
    reduce-scatter / all-gather pair (``rs_*``: row_wise), as TorchRec's estimators price them. fp32
    unless a quantized-comms codec says otherwise; ids, lengths and data_parallel's all-reduce keep theirs."""

    a2a_fwd: float = FP32
    a2a_bwd: float = FP32
    rs_fwd: float = FP32
    rs_bwd: float = FP32

    @classmethod
    def from_qcomm_dtype_sizes(cls, sizes: Optional[Dict[str, Sequence[float]]]) -> "CommElems":
        """From TorchRec's ``SharderData.qcomm_dtype_sizes`` (``{comm op name: (forward bytes,
        backward bytes)}``, what its planner reads off ``sharder.qcomm_codecs_registry``)."""
        sizes = sizes or {}
        a2a = sizes.get(A2A_COMM_OP, (FP32, FP32))
        rs = sizes.get(RS_COMM_OP, (FP32, FP32))
        return cls(float(a2a[0]), float(a2a[1]), float(rs[0]), float(rs[1]))


FP32_COMMS = CommElems()


@dataclass(frozen=True)
class TableTraffic:
    """What one table sees per step on one rank.

    rows, dim: table shape. features: features looking it up (F). pooling: mean ids per bag
    per feature (L). batch: local batch size (B; where features differ in batch size or poolings
    per sample, their mean bags per feature). world: ranks (W). comm: bytes per element
    of its pooled collectives (quantized comms; default fp32).
    """

    rows: int
    dim: int
    features: int
    pooling: float
    batch: float
    world: int
    comm: CommElems = FP32_COMMS

    @property
    def bags(self) -> float:
        return float(self.features * self.batch)

    @property
    def lookups(self) -> float:
        return self.bags * self.pooling


# -- compute: what a rank does besides sending bytes -------------------------------------------
#
# A rank's step is priced as bytes / bandwidth + a linear function of its work (``ComputeCosts``,
# fitted by ``benchmarks/calibrate.py``); ``rank_work`` returns ``[W, len(WORK_TERMS)]`` float64,
# forward + backward, the terms of docs/architecture.md §5 (``group_*``: one per sharding group and
# step, added per plan by :func:`plan_rank_cost`).
WORK_TERMS = ("lookup", "vector_stock", "vector_hybrid", "ids_stock", "ids_hybrid", "group_stock", "group_hybrid")
_W = {name: i for i, name in enumerate(WORK_TERMS)}

# FBGEMM's CPU TBE backward has a vectorised path (SpMDM, the row-wise AdaGrad kernel) only for
# EXACT_ROWWISE_ADAGRAD on a table looked up by one feature. The owner of most of a one-hot table's
# cold rows looks each feature up as W virtual features of it (the sharding's lanes), which takes the
# scalar path: its extra backward per id, as a share of the one-feature lookup's forward + backward per
# id (``python -m benchmarks.tbe_paths``, benchmarks/results/tbe_paths.json; a test keeps the two
# equal), priced as that much more lookup work on such an owner (``FrequencyHybrid.virtual_owners``).
VIRTUAL_BACKWARD_EXTRA = 0.80


def vectorised_cpu_backward(params: Optional[Dict[str, Any]]) -> bool:
    """Whether FBGEMM's CPU TBE backward takes its vectorised path for a table looked up by one
    feature under these fused params - EXACT_ROWWISE_ADAGRAD (none given: FBGEMM's EXACT_SGD, whose
    backward is scalar either way) without weight decay (with it, heavy tables get a call of their
    own, lookup.py): then looking such a table up through virtual features costs its scalar path
    (:data:`VIRTUAL_BACKWARD_EXTRA`). Only the sharder's fused_params are read: an optimizer set per
    parameter (``apply_optimizer_in_backward``) is priced as FBGEMM's default here."""
    p = params or {}
    return (p.get("optimizer", EmbOptimType.EXACT_SGD) == EmbOptimType.EXACT_ROWWISE_ADAGRAD
            and not float(p.get("weight_decay", 0.0) or 0.0))


@dataclass(frozen=True)
class ComputeCosts:
    """Prices of the work terms (``WORK_TERMS``): ns per unit, and ms per sharding group.

    ``ns_per_byte`` is the CPU cost of a byte sent beyond the topology's bandwidth (0 when
    the bandwidth alone prices it). All zero: bytes and collectives only. ``collective_ms``:
    the fixed cost of one collective on the machine measured, fitted from its step times
    (None: the planner's default, :data:`DEFAULT_COLLECTIVE_MS`). ``busiest_share``:
    how much of a step the busiest rank sets, the rest following the mean rank (1: one rank
    per device, the busiest rank is the step; less where ranks share cores and the step
    follows their total work), fitted from the same step times (None: 1). ``rms_ms``: the
    fit's RMS error per rank, the model's resolution (the planner's ``tie_ms="fit_error"``
    takes it as its tie band; None: not known). ``rms_rel``: the same error relative to the
    mean measured per-rank time of the calibration (the planner's default ``tie_ms="auto"``
    bands that share of the cheapest plan's cost: the error grows with the step; None: not known).
    """

    lookup: float = 0.0
    vector_stock: float = 0.0
    vector_hybrid: float = 0.0
    ids_stock: float = 0.0
    ids_hybrid: float = 0.0
    group_stock_ms: float = 0.0
    group_hybrid_ms: float = 0.0
    ns_per_byte: float = 0.0
    collective_ms: Optional[float] = None
    busiest_share: Optional[float] = None
    rms_ms: Optional[float] = None
    rms_rel: Optional[float] = None
    source: str = "none"

    def step_ms(self, rank_ms: torch.Tensor) -> torch.Tensor:
        """A step's cost from each rank's (``[..., W]``): the busiest rank's and the mean
        rank's, weighted by :attr:`busiest_share`."""
        share = 1.0 if self.busiest_share is None else self.busiest_share
        return share * rank_ms.max(-1).values + (1.0 - share) * rank_ms.mean(-1)

    def vector(self) -> torch.Tensor:
        """ms per unit of each work term, in ``WORK_TERMS`` order."""
        ns = [self.lookup, self.vector_stock, self.vector_hybrid, self.ids_stock, self.ids_hybrid]
        return torch.tensor([x * 1e-6 for x in ns] + [self.group_stock_ms, self.group_hybrid_ms], dtype=torch.float64)

    def ms(self, work: torch.Tensor, sent_bytes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Compute time (ms) of ``work`` (``[..., len(WORK_TERMS)]``), plus the extra per-byte cost."""
        out = work @ self.vector()
        if sent_bytes is not None and self.ns_per_byte:
            out = out + sent_bytes * self.ns_per_byte * 1e-6
        return out


def _zeros(world: int) -> torch.Tensor:
    return torch.zeros(world, dtype=torch.float64)


def _work(world: int) -> torch.Tensor:
    return torch.zeros(world, len(WORK_TERMS), dtype=torch.float64)


def _stock_work(t: TableTraffic, lookup: float, vector: float, ids: float) -> torch.Tensor:
    """A stock type's work, every rank alike: lookup, vector_stock and ids_stock."""
    out = _work(t.world)
    out[:, _W["lookup"]], out[:, _W["vector_stock"]], out[:, _W["ids_stock"]] = lookup, vector, ids
    return out


# -- one model per sharding type ------------------------------------------------------------------

class ShardingModel:
    """What one sharding type costs (a subclass per type). ``collectives``: collectives one sharding
    group of the type issues per step, forward + backward, counted on the code and TorchRec 1.8."""

    collectives = 5

    def rank_cost(self, so: ShardingOption, t: TableTraffic, owner: Optional[int] = None, gloo: bool = True,
                  scalar_virtual: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Bytes each rank sends (``[W]``) and each rank's work (``[W, len(WORK_TERMS)]``) per step for
        option ``so``'s table: owners are its shards' ranks (``owner`` for a one-shard option not yet
        placed); ``gloo``: collectives as gloo runs them; ``scalar_virtual``: see ``FrequencyHybrid``."""
        raise NotImplementedError

    def shard_bytes(self, so: ShardingOption, t: TableTraffic, sent: torch.Tensor) -> List[float]:
        """Bytes per step through each shard's owner (sent by it, or to it), ``sent`` from :meth:`rank_cost`
        (a one-shard option on rank 0): here an even share (replicas, row blocks)."""
        return [float(sent.sum()) / max(1, len(so.shards))] * len(so.shards)

    def shard_ms(self, so: ShardingOption, t: TableTraffic, ms: torch.Tensor, compute: ComputeCosts) -> List[float]:
        """Compute ms of each shard of a several-shard option whose ranks cost ``ms``: an even share."""
        return [float(ms.sum()) / len(so.shards)] * len(so.shards)


class StockModel(ShardingModel):
    """A stock type: bytes by collective are the same on every rank but an owner's (``parts``)."""

    def parts(self, t: TableTraffic, shards: int = 1, gloo: bool = False) -> Dict[str, float]:
        raise NotImplementedError

    def mean_bytes(self, t: TableTraffic, shards: int = 1, gloo: bool = False) -> float:
        """Bytes per rank per step, the mean over ranks (``shards``: column shards; ``gloo``: see ``RowWise``)."""
        return float(sum(self.parts(t, shards, gloo).values()))

    def rank_cost(self, so, t, owner=None, gloo=True, scalar_virtual=False):
        return _zeros(t.world) + self.mean_bytes(t, gloo=gloo), self.rank_work(t)


class TableWise(StockModel):
    """Every row on one owner: each other rank sends it its ids (int64) and lengths and gets the pooled
    ``[B, D]`` back, and in backward sends its gradient; the owner looks every rank's ids up. Its group
    issues KJTAllToAll's splits, lengths and values exchanges and the pooled all-to-all both ways (5)."""

    def parts(self, t: TableTraffic, shards: int = 1, gloo: bool = False) -> Dict[str, float]:
        return self._parts(t, 1)

    def _parts(self, t: TableTraffic, shards: int) -> Dict[str, float]:
        remote = (t.world - 1) / t.world  # column shards: the ids go to each, the outputs split by columns
        return {"input": remote * shards * (t.lookups * INT64 + t.bags * INT32),
                "output": remote * t.bags * t.dim * (t.comm.a2a_fwd + t.comm.a2a_bwd)}

    def rank_bytes(self, t: TableTraffic, owner: int, dim: Optional[int] = None) -> torch.Tensor:
        """On ``owner`` (or one column shard of width ``dim``)."""
        d = t.dim if dim is None else dim
        out = _zeros(t.world) + t.lookups * INT64 + t.bags * INT32 + t.bags * d * t.comm.a2a_bwd
        out[owner] = (t.world - 1) * t.bags * d * t.comm.a2a_fwd
        return out

    def rank_work(self, t: TableTraffic, owner: int, dim: Optional[int] = None) -> torch.Tensor:
        """The owner looks up every rank's ids and sends W pooled blocks; every rank permutes its ids
        and receives its block."""
        d, w = (t.dim if dim is None else dim), t.world
        out = _stock_work(t, 0.0, t.bags * d, t.lookups)
        out[owner, _W["lookup"]] += w * t.lookups * d
        out[owner, _W["vector_stock"]] += w * t.bags * d
        out[owner, _W["ids_stock"]] += w * t.lookups
        return out

    def rank_cost(self, so, t, owner=None, gloo=True, scalar_virtual=False):
        rank = owner if owner is not None else (so.shards[0].rank or 0)
        return self.rank_bytes(t, rank), self.rank_work(t, rank)


class ColumnWise(TableWise):
    """Column shards, each a table-wise exchange of its width on its owner (ids to every shard)."""

    def parts(self, t: TableTraffic, shards: int = 1, gloo: bool = False) -> Dict[str, float]:
        return self._parts(t, shards)

    def rank_cost(self, so, t, owner=None, gloo=True, scalar_virtual=False):
        sent, work = _zeros(t.world), _work(t.world)
        for s in so.shards:  # plan-time loop over a table's column shards
            rank = (owner if s.rank is None else s.rank) or 0
            sent += self.rank_bytes(t, rank, dim=s.size[1])
            work += self.rank_work(t, rank, dim=s.size[1])
        return sent, work

    def shard_bytes(self, so, t, sent):
        """Each shard its own exchange, wherever it is placed (a table may have more shards than ranks)."""
        return [float(self.rank_bytes(t, 0, dim=s.size[1]).sum()) for s in so.shards]

    def shard_ms(self, so, t, ms, compute):
        return [float(compute.ms(self.rank_work(t, 0, dim=s.size[1]), self.rank_bytes(t, 0, dim=s.size[1])).sum())
                for s in so.shards]


class RowWise(StockModel):
    """Row blocks on every rank: lengths to all, ids (int64) to their owners; the pooled ``[W*B, D]``
    reduce-scattered and all-gathered back in backward, every rank alike (5 collectives). gloo's
    reduce-scatter sends what its ring all-reduce does, 2(W-1)/W of the input (``gloo``; measured with
    ``comm_bytes``), twice NCCL's (W-1)/W."""

    def parts(self, t: TableTraffic, shards: int = 1, gloo: bool = False) -> Dict[str, float]:
        w = t.world
        reduce_scatter = (2 if gloo else 1) * (w - 1) * t.bags * t.dim * t.comm.rs_fwd
        return {"input": (w - 1) * t.bags * INT32 + (w - 1) / w * t.lookups * INT64,
                "output": reduce_scatter + (w - 1) * t.bags * t.dim * t.comm.rs_bwd}

    def rank_work(self, t: TableTraffic) -> torch.Tensor:
        """Each rank looks up its block's share of every rank's ids and reduce-scatters ``[W*B, D]``."""
        return _stock_work(t, t.lookups * t.dim, (t.world + 1) * t.bags * t.dim, 2 * t.lookups)


class DataParallel(StockModel):
    """A replica on every rank: a ring all-reduce of the whole table's gradient every step (one DDP
    bucket: 1 collective); local lookups."""

    collectives = 1

    def parts(self, t: TableTraffic, shards: int = 1, gloo: bool = False) -> Dict[str, float]:
        return {"sync": 2 * (t.world - 1) / t.world * t.rows * t.dim * FP32}

    def rank_work(self, t: TableTraffic) -> torch.Tensor:
        return _stock_work(t, t.lookups * t.dim, t.rows * t.dim, t.lookups)


@dataclass
class TableProfile:
    """One table's lookup distribution as a hybrid option is sized and priced on it: ``coverage[H]`` (share of
    its lookups on its H most frequent rows, H = 0..K), its ids by rank (None: unknown), the memory of a hot
    row, the owners' shares of its cold lookups the sizing assumes (None: even row blocks) and the owners
    it prices on FBGEMM's scalar CPU backward (``FrequencyHybrid.virtual_owners``; None: none)."""

    traffic: TableTraffic
    coverage: torch.Tensor
    ranked_ids: Optional[torch.Tensor]
    bytes_per_hot_row: int
    source: str = "stats"
    shares: Optional[torch.Tensor] = None
    virtual: Optional[torch.Tensor] = None

    def coverage_at(self, hot_rows: int) -> float:
        return float(self.coverage[min(hot_rows, self.coverage.numel() - 1)])

    def hot_ids(self, hot_rows: int) -> Optional[torch.Tensor]:
        """The ``hot_rows`` most frequent ids, sorted (None when the profile has no ids)."""
        return None if self.ranked_ids is None else torch.sort(self.ranked_ids[:hot_rows]).values

    def row_shares(self, hot_rows: int) -> torch.Tensor:
        """Each row's share of the cold lookups once the ``hot_rows`` most frequent are hot, ``[rows]``
        float64 (rows never counted share the unseen mass evenly; unknown ids: uniform). O(rows)."""
        rows, ranked = self.traffic.rows, self.ranked_ids
        known = 0 if ranked is None else min(ranked.numel(), self.coverage.numel() - 1)
        h = min(hot_rows, known)
        tail = max(0.0, 1.0 - float(self.coverage[known])) / max(1, rows - known)
        share = torch.full((rows,), tail, dtype=torch.float64)
        if ranked is not None and known:
            counts = self.coverage[1:known + 1] - self.coverage[:known]
            share[ranked[:known]] = counts.to(torch.float64)
            share[ranked[:h]] = 0.0
        total = float(share.sum())
        return share / total if total > 0 else torch.full((rows,), 1.0 / max(1, rows), dtype=torch.float64)

    def block_loads(self, hot_rows: int, bounds: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """For row blocks ``bounds`` (``[W+1]``): each owner's share of the cold lookups and the number
        of hot rows it owns (and sends to every replica each step)."""
        b = torch.as_tensor(bounds, dtype=torch.int64)
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.row_shares(hot_rows), 0)])
        shares = cum[b[1:]] - cum[b[:-1]]
        world = b.numel() - 1
        hot = torch.zeros(world, dtype=torch.float64)
        ids = self.hot_ids(hot_rows)
        if ids is not None and ids.numel():
            hot = torch.bincount(row_blocks.owners(ids, b), minlength=world).to(torch.float64)
        elif hot_rows:  # ids unknown: spread like the rows
            hot = (b[1:] - b[:-1]).to(torch.float64) / max(1, self.traffic.rows) * hot_rows
        return shares, hot

    def balanced_bounds(self, hot_rows: int, world: int) -> List[int]:
        """Row blocks of equal owner-side cost: cold lookups (a partial sum to a remote rank each,
        one-hot) and hot rows (sent to every other rank each step), from the statistics."""
        t = self.traffic
        cold_total = max(0.0, 1.0 - self.coverage_at(hot_rows)) * (t.lookups * t.world)  # global cold lookups
        # expected cold lookups per row, each a partial sum to a remote rank w.p. (W-1)/W
        cost = self.row_shares(hot_rows) * cold_total * (world - 1) / world
        ids = self.hot_ids(hot_rows)
        if ids is not None and ids.numel():
            cost[ids] = float(world - 1)  # a hot row: one row-sized send per other rank
        return row_blocks.balanced_bounds(cost, world)

    def cost_curve(self, bw: float, compute: Optional[ComputeCosts] = None) -> torch.Tensor:
        """Step cost (ms) for H = 0..K under the profile's layout (``shares``, else even row blocks): bytes /
        ``bw``, plus with ``compute`` prices the mean rank's work."""
        h = torch.arange(self.coverage.numel(), dtype=torch.float64)
        w = self.traffic.world
        shares = self.shares if self.shares is not None else torch.full((w,), 1.0 / w, dtype=torch.float64)
        sent = HYBRID.layout_bytes(self.traffic, self.coverage, h, shares)
        curve = sent / bw
        if compute is not None:
            curve = curve + compute.ms(HYBRID.mean_work(self.traffic, self.coverage, h, shares,
                                                        virtual=self.virtual), sent)
        return curve


def coverage_from_counts(counts: Sequence[float] | torch.Tensor, total: Optional[float] = None,
                         max_rows: Optional[int] = None) -> torch.Tensor:
    """``coverage[H]`` for H = 0..len from per-row counts (any order; sorted here). ``total``: the
    table's lookups (default the counts' sum; pass it when they are only a sketch's top rows)."""
    c = torch.sort(torch.as_tensor(counts, dtype=torch.float64).flatten(), descending=True).values
    if max_rows is not None:
        c = c[:max_rows]
    tot = float(c.sum()) if total is None else float(total)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(c, 0)])
    return (cum / tot).clamp_(0.0, 1.0) if tot > 0 else torch.zeros_like(cum)


def uniform_coverage(rows: int, max_rows: int) -> torch.Tensor:
    """Coverage if every row were equally likely (the no-statistics assumption)."""
    return torch.arange(min(rows, max_rows) + 1, dtype=torch.float64) / max(rows, 1)


def _curves(coverage, hot_rows) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``coverage`` and ``hot_rows`` (numbers or curves) as float64 tensors, and the cold share."""
    cov = torch.as_tensor(coverage, dtype=torch.float64)
    return cov, torch.as_tensor(hot_rows, dtype=torch.float64), (1.0 - cov).clamp(min=0.0)


def _hit(t: TableTraffic, cold, shares: torch.Tensor) -> torch.Tensor:
    """P(a bag holds >= 1 cold id of an owner of each share of the cold lookups)."""
    return 1.0 - torch.pow(1.0 - cold * shares.to(torch.float64), t.pooling)


def _hit_sum(t: TableTraffic, cold: torch.Tensor, shares: torch.Tensor,
             share_counts: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum over owners of :func:`_hit` (``cold`` a curve; ``share_counts``: owners per share), with
    the shares and counts as float64."""
    m = shares.to(torch.float64)
    n = torch.ones_like(m) if share_counts is None else share_counts.to(torch.float64)
    return (_hit(t, cold.unsqueeze(-1), m) * n).sum(-1), m, n


class FrequencyHybrid(ShardingModel):
    """frequency_hybrid: H hot rows replicated, the cold ones in row blocks (row-wise cold: one per
    rank; table-wise cold: one owner) or column slices each on one owner. With ``coverage`` (c = 1 -
    coverage of the cold lookups) per step and rank: the cold ids and their bags' lengths to their
    owners in rooms ``ROOM_SLACK`` times that (cold_all_to_all.py), one partial sum per bag with a
    cold id on a remote owner forward and backward (``1 - (1 - c m_j)^L`` per owner j of share
    ``m_j``), and each owner's hot rows to every rank and their gradients back (an upper bound:
    with some optimizers only rows looked up travel). docs/architecture.md §5 derives the formulas.

    Its group issues the cold ids' all-to-all (a second on the rare step that spills) and the output
    all-to-all both ways: 3. Options carry their ``hybrid_choice`` (coverage, H, the
    :class:`TableProfile`) on which they are priced."""

    collectives = 3

    def parts(self, t: TableTraffic, coverage, hot_rows) -> Dict[str, torch.Tensor]:
        """Bytes per rank by collective with even row blocks (``coverage`` and ``hot_rows`` may be
        tensors of one shape: a whole curve at once): {"lengths", "cold_ids", "partials", "hot_sync"}."""
        w = t.world
        cov, h, cold = _curves(coverage, hot_rows)
        remote = (w - 1) / w
        # P(a bag has >= 1 cold id on a given owner) = 1 - (1 - c/W)^L, for each of W-1 remote owners
        bag_hit = 1.0 - torch.pow(1.0 - cold / w, t.pooling) if w > 1 else torch.zeros_like(cold)
        both = t.comm.a2a_fwd + t.comm.a2a_bwd  # the output all-to-all, forward + backward (2 * FP32)
        return {
            "lengths": (w - 1) * (t.bags * bag_hit * INT32 * ROOM_SLACK + t.features * 2 * INT32),
            "cold_ids": cold * remote * t.lookups * INT32 * ROOM_SLACK,
            "partials": both * t.dim * t.bags * (w - 1) * bag_hit,
            "hot_sync": 2 * remote * h * t.dim * (both / 2),
        }

    def mean_bytes(self, t: TableTraffic, coverage, hot_rows) -> torch.Tensor:
        """The sum of :meth:`parts` (every part is a tensor, so is the sum)."""
        return cast(torch.Tensor, sum(self.parts(t, coverage, hot_rows).values()))

    def best_hot_rows(self, t: TableTraffic, coverage: torch.Tensor, max_rows: Optional[int] = None) -> int:
        """Brute-force argmin of :meth:`mean_bytes` over H <= max_rows (ties: smaller H)."""
        curve = self.mean_bytes(t, coverage, torch.arange(coverage.numel(), dtype=torch.float64))
        return int(torch.argmin(curve if max_rows is None else curve[: max(0, int(max_rows)) + 1]))

    def layout_bytes(self, t: TableTraffic, coverage, hot_rows, shares: torch.Tensor,
                     share_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean bytes per rank of any cold layout, hot rows spread as the cold lookups are (hot-set
        sizing; ``coverage`` and ``hot_rows`` may be curves). ``shares``: each owner's share of the cold
        lookups, or with ``share_counts`` the distinct shares and how many owners have each."""
        w = t.world
        _, h, cold = _curves(coverage, hot_rows)
        hit_sum = _hit_sum(t, cold, shares, share_counts)[0]
        remote = (w - 1) / w
        per_rank_bags = remote * t.bags * hit_sum  # bags sent to remote owners, per rank
        both = t.comm.a2a_fwd + t.comm.a2a_bwd  # the output all-to-all, forward + backward
        return (per_rank_bags * (INT32 * ROOM_SLACK + 2 * t.dim * (both / 2))
                + cold * remote * t.lookups * INT32 * ROOM_SLACK
                + 2 * remote * h * t.dim * (both / 2) + (w - 1) * t.features * 2 * INT32)

    def owner_hit(self, t: TableTraffic, coverage, shares: torch.Tensor) -> torch.Tensor:
        """P(a bag holds >= 1 cold id owned by rank j), ``[W]``."""
        return _hit(t, max(0.0, 1.0 - float(coverage)), shares)

    def rank_bytes(self, t: TableTraffic, coverage, shares: torch.Tensor, hot_per_owner: torch.Tensor
                   ) -> torch.Tensor:
        """Bytes each rank sends with owner j holding ``shares[j]`` of the cold lookups and
        ``hot_per_owner[j]`` hot rows. Rank r sends to each other owner j the lengths of its bags with
        cold ids there, those ids, in backward their partial sums' gradients and the gradients of j's
        hot rows; as an owner, its partial sums to every other rank and its hot rows to every replica.
        (The header's counts per feature are the module's: :func:`module_overhead_rank_bytes`.)"""
        w = t.world
        cold = max(0.0, 1.0 - float(coverage))
        hit = self.owner_hit(t, coverage, shares)  # [W]
        hot = hot_per_owner.to(torch.float64)
        fwd, bwd = t.comm.a2a_fwd, t.comm.a2a_bwd  # the output all-to-all's bytes per element
        to_owner = t.bags * hit * (INT32 * ROOM_SLACK + t.dim * bwd) \
            + t.lookups * cold * shares.to(torch.float64) * INT32 * ROOM_SLACK \
            + hot * t.dim * bwd  # what any rank sends to owner j (0 when j is itself)
        out = to_owner.sum() - to_owner  # to every owner but itself
        out += (w - 1) * (t.bags * hit * t.dim * fwd + hot * t.dim * fwd)
        return out

    def rank_work(self, t: TableTraffic, coverage, shares: torch.Tensor, hot_per_owner: torch.Tensor,
                  virtual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Every rank routes its ids, moves the hot ones to the front and pools them against the replica,
        assembles the replica and unpacks the partial sums it gets back; owner j looks up its share of
        every rank's cold ids and its hot rows, and packs partial sums and W copies of the rows.
        ``virtual`` (bool ``[W]``): the owners on FBGEMM's scalar CPU backward (:meth:`virtual_owners`),
        whose own lookups cost :data:`VIRTUAL_BACKWARD_EXTRA` more."""
        w, d = t.world, t.dim
        cov = float(coverage)
        cold = max(0.0, 1.0 - cov)
        hit = self.owner_hit(t, coverage, shares)  # [W]
        m = shares.to(torch.float64)
        hot = hot_per_owner.to(torch.float64)
        out = _work(w)
        owned = (cold * m * w * t.lookups + hot) * d  # the owner's lookups: its cold ids and its hot rows
        out[:, _W["lookup"]] = min(cov, 1.0) * t.lookups * d + owned
        if virtual is not None:
            out[:, _W["lookup"]] += VIRTUAL_BACKWARD_EXTRA * owned * virtual.to(torch.float64)
        out[:, _W["vector_hybrid"]] = (float(hit.sum()) + 1.0) * t.bags * d + float(hot.sum()) * d \
            + w * t.bags * hit * d + w * hot * d
        out[:, _W["ids_hybrid"]] = t.lookups + cold * m * w * t.lookups
        return out

    def mean_work(self, t: TableTraffic, coverage, hot_rows, shares: torch.Tensor,
                  share_counts: Optional[torch.Tensor] = None, virtual: Optional[torch.Tensor] = None
                  ) -> torch.Tensor:
        """The mean over ranks of :meth:`rank_work`, hot rows spread as the cold lookups (hot-set sizing;
        ``coverage`` and ``hot_rows`` may be curves): ``[..., len(WORK_TERMS)]``; ``virtual`` per share."""
        cov, h, cold = _curves(coverage, hot_rows)
        hit_sum, m, n = _hit_sum(t, cold, shares, share_counts)
        out = torch.zeros(cov.shape + (len(WORK_TERMS),), dtype=torch.float64)
        out[..., _W["lookup"]] = t.lookups * t.dim * (cov.clamp(max=1.0) + cold) + h * t.dim / t.world
        if virtual is not None:  # the owners' lookups (cold ids, hot rows) through virtual features, over the ranks
            owned = (cold.unsqueeze(-1) * m * t.world * t.lookups + h.unsqueeze(-1) * m) * t.dim
            out[..., _W["lookup"]] += VIRTUAL_BACKWARD_EXTRA * (owned * virtual.to(torch.float64) * n).sum(-1) / t.world
        out[..., _W["vector_hybrid"]] = (2.0 * hit_sum + 1.0) * t.bags * t.dim + 2.0 * h * t.dim
        out[..., _W["ids_hybrid"]] = t.lookups * (1.0 + cold)
        return out

    def memory_bytes(self, t: TableTraffic, hot_rows: int, optimizer_bytes_per_row: int = 0,
                     cold_rows: Optional[int] = None, elem: int = FP32) -> int:
        """Per-rank memory: the hot replica (>= 1 row, no optimizer state: the owners update) + the cold
        block (``cold_rows``, default an even row-wise block) with its optimizer state; ``elem``: bytes
        per weight."""
        cold = math.ceil(t.rows / t.world) if cold_rows is None else cold_rows
        return max(hot_rows, 1) * t.dim * elem + cold * (t.dim * elem + optimizer_bytes_per_row)

    def step_buffer_bytes(self, t: TableTraffic, elem: int = FP32) -> int:
        """Per-rank memory of one step's buffers: the input ids (int64), the owner's ``[W*B, D]``
        partial sums and the ``[B, D]`` hot sums per feature."""
        return math.ceil(t.lookups * INT64 + (t.world + 1) * t.bags * t.dim * elem)

    # -- an option: its slices, their row blocks and loads -----------------------------------------
    def column_sliced(self, so: ShardingOption) -> bool:
        """Whether a hybrid option is column-wise cold (shards are column slices, not row blocks)."""
        return so.sharding_type == FREQUENCY_HYBRID and any(s.offset[1] != 0 for s in so.shards)

    def bounds(self, so: ShardingOption, world: int, owner: Optional[int] = None) -> List[int]:
        """Row bounds of a row-laid option (table-wise cold: on ``owner``, default its shard's rank)."""
        if len(so.shards) == 1:
            rank = owner if owner is not None else (so.shards[0].rank or 0)
            return row_blocks.single_owner_bounds(so.tensor.shape[0], world, rank)
        return [0] + [int(s.offset[0] + s.size[0]) for s in so.shards]

    def loads(self, so: ShardingOption, t: TableTraffic, owner: Optional[int] = None
              ) -> List[Tuple[TableTraffic, List[int], torch.Tensor, torch.Tensor]]:
        """Per column slice (one of the full width for row layouts): its traffic, row bounds (column-wise
        cold: every row of slice s on its shard's rank, ``owner`` while unplaced), owners' shares of its
        cold lookups and hot rows per owner."""
        ch, rows = so.hybrid_choice, int(so.tensor.shape[0])
        if not self.column_sliced(so):
            slices = [(int(so.tensor.shape[1]), self.bounds(so, t.world, owner))]
        else:
            ranks = [(owner if s.rank is None else s.rank) or 0 for s in so.shards]
            slices = [(int(s.size[1]), [0] * (r + 1) + [rows] * (t.world - r)) for s, r in zip(so.shards, ranks)]
        return [(t if width == t.dim else dataclasses.replace(t, dim=width), bounds,
                 *ch.profile.block_loads(ch.hot_rows, bounds)) for width, bounds in slices]

    def virtual_owners(self, t: TableTraffic, bounds: List[int], scalar_virtual: bool,
                       so: Optional[ShardingOption] = None) -> Optional[torch.Tensor]:
        """The owners (bool ``[W]``) that look a table laid out in row blocks ``bounds`` up through
        virtual features on FBGEMM's scalar CPU backward, as the lookup builds them: the owners of most
        of its rows (``row_blocks.heavy_tables``) when ``scalar_virtual`` (``TrafficTable.scalar_virtual``)
        and the table has one feature (``so``'s module config, else ``t.features``: several take the
        scalar path in every layout), one-id bags (multi-hot ones get a TBE call of their own,
        ``row_blocks.MULTI_HOT_POOLING``) and, for an option, fp32 weights; None when there are none."""
        if not scalar_virtual or (so is not None and so.tensor.dtype != torch.float32):
            return None
        features = None if so is None else _option_features(so)
        if (t.features if features is None else features) != 1 or t.pooling >= row_blocks.MULTI_HOT_POOLING:
            return None
        heavy = row_blocks.heavy_tables(t.world, [b - a for a, b in zip(bounds, bounds[1:])], [t.rows] * t.world)
        return torch.tensor(heavy, dtype=torch.bool) if any(heavy) else None

    def rank_cost(self, so, t, owner=None, gloo=True, scalar_virtual=False):
        """Column-wise cold: the sum of its slices, each laid out table-wise."""
        sent, work, cov = _zeros(t.world), _work(t.world), so.hybrid_choice.coverage
        for ts, bounds, shares, hot in self.loads(so, t, owner):
            sent += self.rank_bytes(ts, cov, shares, hot)
            work += self.rank_work(ts, cov, shares, hot, self.virtual_owners(ts, bounds, scalar_virtual, so))
        return sent, work

    def shard_bytes(self, so, t, sent):
        """One shard: all of it; a column slice: its traffic wherever it is placed; a row block on rank i:
        what i sends as its owner + what each other rank sends it."""
        cov = so.hybrid_choice.coverage
        if len(so.shards) == 1:
            return [float(sent.sum())]
        if self.column_sliced(so):
            return [float(self.rank_bytes(ts, cov, shares, hot).sum()) for ts, _, shares, hot in self.loads(so, t, 0)]
        _, _, shares, hot = self.loads(so, t)[0]
        own = torch.eye(t.world, dtype=torch.float64)
        return [float(self.rank_bytes(t, cov, shares * own[i], hot * own[i]).sum()) for i in range(len(so.shards))]

    def shard_ms(self, so, t, ms, compute):
        """A row block: its rank's; column slices: an even share."""
        if self.column_sliced(so):
            return super().shard_ms(so, t, ms, compute)
        return [float(ms[i]) for i in range(len(so.shards))]


MODELS: Dict[str, ShardingModel] = {TABLE_WISE: TableWise(), COLUMN_WISE: ColumnWise(), ROW_WISE: RowWise(),
                                    DATA_PARALLEL: DataParallel(), FREQUENCY_HYBRID: FrequencyHybrid()}
# TorchRec's two-level types, priced per option as their one-level family (no mean model of their own)
FAMILIES = {"table_column_wise": COLUMN_WISE, "table_row_wise": ROW_WISE, "grid_shard": ROW_WISE}
HYBRID = cast(FrequencyHybrid, MODELS[FREQUENCY_HYBRID])


def model(sharding_type: str) -> ShardingModel:
    """The model pricing options of ``sharding_type`` (ValueError: none)."""
    found = MODELS.get(FAMILIES.get(sharding_type, sharding_type))
    if found is None:
        raise ValueError(f"no cost model for sharding type {sharding_type!r}")
    return found


def _option_features(so: ShardingOption) -> Optional[int]:
    """How many features look the option's table up, from its module's config (None: not found).
    ``so.input_lengths`` tells only with per-feature statistics or constraints: TorchRec's
    enumerator gives a table without them one pooling factor, whatever its features."""
    module = so.module[1] if so.module else None
    configs = getattr(module, "embedding_bag_configs", None)
    for c in (configs() if callable(configs) else []):
        if c.name == so.name:
            return len(c.feature_names)
    return None


# -- options and plans ----------------------------------------------------------------------------

FEATURE_BATCH_SIZES = "feature_batch_sizes"  # the attribute stamp_feature_batches sets on an option


def stamp_feature_batches(so: ShardingOption, constraints: Optional[Dict[str, ParameterConstraints]]) -> None:
    """Records on ``so`` what its constraints say of each feature's batch, as TorchRec's perf
    estimator reads them: ``batch_sizes`` (else the planner's batch) and ``num_poolings`` (the
    option's own first, ``shard_estimators.get_num_poolings``), so :func:`traffic_of` prices the
    same bags (an option cloned from this one keeps them)."""
    c = (constraints or {}).get(so.name)
    n = len(so.input_lengths)
    sizes = list(c.batch_sizes) if c is not None and c.batch_sizes else [so.batch_size] * n
    if len(sizes) != n:
        raise ValueError(f"table '{so.name}': constraints batch_sizes has {len(sizes)} entries for its {n} "
                         "features (one per feature, as TorchRec's planner reads them)")
    so.num_poolings = list(get_num_poolings(constraints, so))
    setattr(so, FEATURE_BATCH_SIZES, sizes)


def traffic_of(so: ShardingOption, world_size: int, comm: CommElems = FP32_COMMS) -> TableTraffic:
    """The cost model's view of a sharding option (``comm``: its sharder's quantized comms): its bags
    per step summed over features - each feature's batch times its poolings per sample, as stamped by
    :func:`stamp_feature_batches`, else the planner's batch and one - and pooling the mean ids per bag
    over those bags."""
    lengths = list(so.input_lengths) or [1.0]
    feats = len(lengths)
    polls = so.num_poolings if so.num_poolings is not None and len(so.num_poolings) == feats else [1.0] * feats
    sizes = getattr(so, FEATURE_BATCH_SIZES, None) or [so.batch_size] * feats
    bags = [float(b) * p for b, p in zip(sizes, polls)]
    total = sum(bags)
    pooling = sum(length * b for length, b in zip(lengths, bags)) / total if total > 0 else sum(lengths) / feats
    return TableTraffic(rows=so.tensor.shape[0], dim=so.tensor.shape[1], features=feats, pooling=pooling,
                        batch=total / feats, world=world_size, comm=comm)


@dataclass
class TrafficTable:
    """The workload the model prices: per table its traffic (pooling from the statistics; absent: the
    option's, :func:`traffic_of`), per module type (``ShardingOption.module_type_key``) its sharder's
    quantized comms (``comms``; absent: fp32) and whether its fused optimizer has FBGEMM's vectorised
    CPU backward for a table of one feature (``vectorised``, :func:`vectorised_cpu_backward`)."""

    traffic: Dict[str, TableTraffic]
    gloo: bool = True
    comms: Dict[str, CommElems] = field(default_factory=dict)
    vectorised: Dict[str, bool] = field(default_factory=dict)

    def scalar_virtual(self, so: ShardingOption) -> bool:
        """Whether an owner that looks ``so``'s table up through virtual features leaves FBGEMM's
        vectorised backward for its scalar path (on CPU only)."""
        return self.gloo and self.vectorised.get(so.module_type_key, False)

    def of(self, so: ShardingOption, world: int, comm: Optional[CommElems] = None) -> TableTraffic:
        """``so``'s traffic, with ``comm`` (else its module type's quantized comms)."""
        t = self.traffic.get(so.name)
        t = t if t is not None else traffic_of(so, world)
        comm = comm if comm is not None else self.comms.get(so.module_type_key)
        return t if comm is None or comm == t.comm else dataclasses.replace(t, comm=comm)


def a2a_bandwidth(topology: Topology) -> float:
    """The topology's all-to-all bandwidth (bytes/ms), what every byte is priced at."""
    return topology.comms_bandwidths.get_bw(world_size=topology.world_size, collective_type=CollectiveType.ALL_TO_ALL,
                                            local_world_size=topology.local_world_size)


def shard_costs(so: ShardingOption, traffic: TrafficTable, world: int, bw: float, sharder_data: Any = None,
                compute: Optional[ComputeCosts] = None) -> List[Tuple[float, float]]:
    """(compute ms, comms ms) of each shard of ``so``, what ``estimators.BytesPerfEstimator`` puts in
    its ``Perf``: comms, the bytes of its table through its owner / ``bw``; compute, the work of its
    table on its owner at ``compute`` prices (0 without), all of it for a one-shard option (priced on
    rank 0: by symmetry any owner costs the same). ``sharder_data``: TorchRec's ``SharderData`` of its
    sharder (its quantized comms and fused params, as TorchRec's planner reads them; None: none)."""
    sizes = getattr(sharder_data, "qcomm_dtype_sizes", None)
    comm = None if sharder_data is None else CommElems.from_qcomm_dtype_sizes(sizes)
    scalar_virtual = traffic.gloo and vectorised_cpu_backward(getattr(sharder_data, "fused_params", None))
    t = traffic.of(so, world, comm)
    m = model(so.sharding_type)
    single = len(so.shards) == 1
    sent, work = m.rank_cost(so, t, 0 if single else None, traffic.gloo, scalar_virtual)
    comms = [b / bw for b in m.shard_bytes(so, t, sent)]
    if compute is None:
        return [(0.0, c) for c in comms]
    ms = compute.ms(work, sent)
    return list(zip([float(ms.sum())] if single else m.shard_ms(so, t, ms, compute), comms))


def option_mean_bytes(so: ShardingOption, world_size: int) -> Optional[float]:
    """Mean bytes per rank per step of one planned option, as the hot-set sizing priced it
    (hybrid: its cold layout's, ``HotSetChoice.bytes_per_step``); None: type not modelled."""
    choice = getattr(so, "hybrid_choice", None)
    if so.sharding_type == FREQUENCY_HYBRID:
        return None if choice is None else float(choice.bytes_per_step)
    m = MODELS.get(so.sharding_type)
    return m.mean_bytes(traffic_of(so, world_size), shards=len(so.shards)) if isinstance(m, StockModel) else None


def sharding_groups(options: Iterable[ShardingOption]) -> Dict[str, set]:
    """Sharding types per module path (each is one sharding group with its own collectives)."""
    out: Dict[str, set] = {}
    for so in options:
        out.setdefault(so.path, set()).add(so.sharding_type)
    return out


def stock_input_dists(types: Iterable[str]) -> int:
    """Stock KJTAllToAll input dists of a sharded module: one per sharding type in it, but
    data_parallel (none) and frequency_hybrid (its own cold all-to-all)."""
    return len(set(types) - {DATA_PARALLEL, FREQUENCY_HYBRID})


def module_overhead_bytes(world: int, types: Iterable[str], validate_ids: bool = True,
                          splits_per_dist: int = 3) -> float:
    """Per sharded module (its sharding ``types``) and step, mean over ranks: the id-check verdicts
    (3 int64 per peer, as extra rows of a stock splits exchange or, in a module of data_parallel
    tables only, an all-to-all of their own; with a frequency_hybrid sharding 4 int32 words per
    peer in its cold ids' header, which also carries a spill flag and the rooms' pad of ``ROOM_PAD``
    words per peer, checked or not) + each stock KJTAllToAll's splits exchange."""
    types = set(types)
    hybrid = FREQUENCY_HYBRID in types
    per_peer = 4 * INT32 if hybrid else 3 * INT64
    check = (world - 1) * per_peer if validate_ids else 0
    rooms = (world - 1) * (1 + ROOM_PAD) * INT32 if hybrid else 0
    return float(check + rooms + stock_input_dists(types) * (world - 1) * splits_per_dist * INT64)


def module_overhead_rank_bytes(world: int, types: Iterable[str], hybrid_features: int,
                               validate_ids: bool = True) -> torch.Tensor:
    """Per sharded module and step, every rank alike: :func:`module_overhead_bytes` plus the
    hybrid header's two int32 counts per hybrid feature and peer (in ``FrequencyHybrid.parts``
    for the mean model)."""
    per_module = module_overhead_bytes(world, types, validate_ids) + (world - 1) * hybrid_features * 2 * INT32
    return _zeros(world) + per_module


def collectives_per_step(options: List[ShardingOption]) -> int:
    """Collectives a plan issues per step (per module: each sharding group's own, ``collectives`` of
    its model; unknown types 5), plus, for a module of data_parallel tables alone, the small all-to-all
    of its id-check verdicts (other modules' verdicts ride a split-size exchange they make anyway)."""
    n = 0
    for types in sharding_groups(options).values():
        n += sum(getattr(MODELS.get(FAMILIES.get(t, t)), "collectives", 5) for t in types)
        if not stock_input_dists(types) and FREQUENCY_HYBRID not in types:
            n += 1  # the id check's own all-to-all (else it rides the hybrid header or a stock splits exchange)
    return n


def plan_rank_cost(options: List[ShardingOption], traffic: TrafficTable, world: int,
                   validate_ids: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bytes each rank sends and each rank's work per step under a partitioned plan: its tables'
    (``rank_cost``) plus, per module, the overhead bytes and one fixed work term per sharding group."""
    sent, work = _zeros(world), _work(world)
    for so in options:
        b, w = model(so.sharding_type).rank_cost(so, traffic.of(so, world), None, traffic.gloo,
                                                 traffic.scalar_virtual(so))
        sent += b
        work += w
    for path, types in sharding_groups(options).items():
        hybrid_features = sum(traffic.of(so, world).features for so in options
                              if so.path == path and so.sharding_type == FREQUENCY_HYBRID)
        sent += module_overhead_rank_bytes(world, types, hybrid_features, validate_ids)
        work[:, _W["group_stock"]] += len(types - {FREQUENCY_HYBRID})
        work[:, _W["group_hybrid"]] += int(FREQUENCY_HYBRID in types)
    return sent, work


def plan_rank_memory(options: List[ShardingOption], world: int, on_device: bool) -> torch.Tensor:
    """Memory each rank holds under a partitioned plan, bytes: its shards' storage (what the
    partitioner counted: HBM on a GPU, else DDR) plus what a frequency_hybrid table puts on the
    ranks its shards do not cover - every rank holds the table's full hot replica and pools its
    own lookups, but a table-wise (column-wise) cold option's shards count the replica (its
    slice's width of it) on the owner (slice owners) alone: the rest of the replica, the step's
    buffers and the one cold row a non-owner keeps (row_blocks.py)."""
    mem = _zeros(world)
    for so in options:
        widths = _zeros(world)
        for shard in so.shards:
            if shard.rank is None or shard.storage is None:
                continue
            mem[shard.rank] += shard.storage.hbm if on_device else shard.storage.ddr
            widths[shard.rank] += shard.size[1]
        choice = getattr(so, "hybrid_choice", None)
        if so.sharding_type != FREQUENCY_HYBRID or choice is None:
            continue
        dim, elem = so.tensor.shape[1], so.tensor.element_size()
        missing = (dim - widths).clamp(min=0)
        uncovered = (widths == 0).to(torch.float64)
        mem += missing * max(choice.hot_rows, 1) * elem
        mem += uncovered * (HYBRID.step_buffer_bytes(traffic_of(so, world), elem) + dim * elem)
    return mem


# Fixed cost of one collective, ms, where no fit gives one (~0.2 MB at 1 GiB/s). Measured on
# gloo over loopback it depends on the box: alone behind a barrier, 4 ranks on 2 cores took
# about 1-3 ms per small all-to-all (benchmarks/results/comm_floor.md), 2 ranks a tenth of
# that; inside a step it overlaps other ranks' compute, and the CPU fit puts it near 0
# (benchmarks/results/calibration.md).
DEFAULT_COLLECTIVE_MS = 0.2


def plan_cost(options: List[ShardingOption], traffic: TrafficTable, topology: Topology,
              collective_ms: float = DEFAULT_COLLECTIVE_MS, compute: Optional[ComputeCosts] = None
              ) -> Tuple[Dict[str, float], torch.Tensor]:
    """Step cost of a partitioned plan and the bytes each rank sends: the busiest rank's bytes /
    bandwidth + its compute (``compute`` prices; None: none; where the prices say ranks share cores,
    blended with the mean rank's, ``ComputeCosts.step_ms``), + a fixed cost per collective."""
    w = topology.world_size
    per_rank, work = plan_rank_cost(options, traffic, w)
    n = collectives_per_step(options)
    bw = a2a_bandwidth(topology)
    work_ms = compute.ms(work, per_rank) if compute else torch.zeros(w)
    rank_ms = per_rank / bw + work_ms
    busiest = int(torch.argmax(rank_ms))
    step = float(compute.step_ms(rank_ms)) if compute else float(rank_ms[busiest])
    return {"cost_ms": step + n * collective_ms, "busiest_bytes": float(per_rank.max()),
            "mean_bytes": float(per_rank.mean()), "collectives": float(n),
            "compute_ms": float(work_ms[busiest]), "bytes_ms": float(per_rank[busiest]) / bw}, per_rank
