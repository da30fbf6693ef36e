"""Bytes sent per rank per training step, for each sharding type (pure functions).

This is the communication model of docs/architecture.md §5, made exact for what the code in
this repository and stock TorchRec 1.8 put on the wire (fp32 embeddings, gloo ring
collectives, W ranks, local batch B). Quantized comms (a sharder's ``qcomm_codecs_registry``)
change the bytes per element of the pooled collectives, forward and backward apart
(:class:`CommElems`, carried by each :class:`TableTraffic`): the pooled all-to-all of
table_wise / column_wise and the hybrid's output all-to-all (partial sums and hot-row
sync) take ``POOLED_EMBEDDINGS_ALL_TO_ALL``'s, row_wise's reduce-scatter and all-gather
``POOLED_EMBEDDINGS_REDUCE_SCATTER``'s, as TorchRec's own estimators price them; ids,
lengths and data_parallel's all-reduce stay as they are. The formulas below are written
for fp32 (4 bytes per element each way). Every function returns *bytes sent by one rank in one
step* (averaged over ranks), so a figure can be checked against ``wchar`` of
``/proc/self/io`` (see ``torchrec_hybrid.comm_bytes``). No torchrec objects: the
benchmarks and the planner both import this file.

Per table the inputs are a :class:`TableTraffic`; for frequency-hybrid also the hot
coverage: ``coverage[H]`` = share of the table's lookups that fall on its H most frequent
rows (``coverage[0] == 0``, non-decreasing), e.g. from :func:`coverage_from_counts`.

Frequency-hybrid per step and rank (see torchrec_hybrid/sharding/*):
- input dist (cold_all_to_all.py): to each other rank the lengths of the bags holding >= 1
  cold id it owns (int32) and the cold ids it owns (int32), in rooms ``ROOM_SLACK`` times that
  (what a room is sized to from the runs before; it stays put while the runs fit it and it is at most twice
  a fresh one, so this prices a room as freshly sized; the whole room travels), and in the header two int32 counts per
  feature: ``s*(4*F*B*(W-1)*(1-(1-c/W)**L) + c*(W-1)/W*F*B*L*4) + (W-1)*F*8`` (c = 1 - coverage,
  s = ``ROOM_SLACK``);
- output dist: one D-float partial per (owner, feature, sample) bag holding >= 1 cold id of
  a remote owner, forward and again backward: ``2*D*4*F*B*(W-1)*(1-(1-c/W)**L)``
  (exactly ``c*(W-1)/W`` bags per bag for one-hot; independent ids per bag otherwise);
- hot sync, in the same all-to-alls: forward, each owner sends its hot rows to every other
  rank; backward, each rank sends the gradients of the other owners' hot rows:
  ``2*(W-1)/W*H*D*4``. (With an optimizer that changes rows on a zero gradient - weight
  decay, Adam - only rows some rank looked up travel, plus an all-gather of H-byte masks;
  this prices the upper bound.)
Per sharded module (not per table): the id-check verdicts (4 int32 per peer in the hybrid
header, with its spill flag and the rooms' ``ROOM_PAD`` words, else 3 int64 per peer in a stock
KJTAllToAll's splits exchange or, with neither, an all-to-all of their own) and the small splits
exchange of each stock KJTAllToAll (:func:`module_overhead_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, cast

import torch

from torchrec_hybrid.types import ROOM_PAD, ROOM_SLACK

FP32 = 4
INT32 = 4
INT64 = 8

TABLE_WISE = "table_wise"
COLUMN_WISE = "column_wise"
ROW_WISE = "row_wise"
DATA_PARALLEL = "data_parallel"
FREQUENCY_HYBRID = "frequency_hybrid"

# Optimizer state bytes per row as a function of dim (fp32 state), by FBGEMM/TorchRec name.
_OPTIMIZER_STATE = {k.replace("_", ""): v for k, v in {  # keys without underscores: "RowWiseAdagrad" matches too
    "sgd": lambda d: 0, "exact_sgd": lambda d: 0,
    "rowwise_adagrad": lambda d: 4, "exact_rowwise_adagrad": lambda d: 4,
    "adagrad": lambda d: 4 * d, "exact_adagrad": lambda d: 4 * d,
    "adam": lambda d: 8 * d, "lamb": lambda d: 8 * d,
    "partial_rowwise_adam": lambda d: 4 * d + 4, "partial_rowwise_lamb": lambda d: 4 * d + 4,
}.items()}


A2A_COMM_OP = "POOLED_EMBEDDINGS_ALL_TO_ALL"  # TorchRec CommOp names (qcomm_codecs_registry keys)
RS_COMM_OP = "POOLED_EMBEDDINGS_REDUCE_SCATTER"


@dataclass(frozen=True)
class CommElems:
    """Bytes per element of pooled vectors on the wire, forward and backward: the pooled
    all-to-all (``a2a_*``) and the reduce-scatter / all-gather pair (``rs_*``). fp32 unless a
    quantized-comms codec says otherwise (:meth:`from_qcomm_dtype_sizes`)."""

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


def optimizer_state_bytes_per_row(optimizer: Optional[str], dim: int) -> int:
    """fp32 optimizer state per embedding row (unknown names: as much as the weights)."""
    if optimizer is None:
        return 0
    key = str(optimizer).lower().rsplit(".", 1)[-1].replace("_", "")  # EmbOptimType names, torch.optim classes
    fn = _OPTIMIZER_STATE.get(key)
    return fn(dim) if fn else 4 * dim


# -- stock sharding types -----------------------------------------------------------------

def table_wise_bytes(t: TableTraffic, id_bytes: int = INT64, length_bytes: int = INT32) -> Dict[str, float]:
    """TW: ids + lengths to the owner, pooled [B, D] back and its gradient forward again."""
    remote = (t.world - 1) / t.world
    return {
        "input": remote * (t.lookups * id_bytes + t.bags * length_bytes),
        "output": remote * t.bags * t.dim * (t.comm.a2a_fwd + t.comm.a2a_bwd),
    }


def column_wise_bytes(t: TableTraffic, num_shards: int, id_bytes: int = INT64,
                      length_bytes: int = INT32) -> Dict[str, float]:
    """CW: TW per column shard; ids and lengths go to every shard, outputs split by columns."""
    remote = (t.world - 1) / t.world
    return {
        "input": remote * num_shards * (t.lookups * id_bytes + t.bags * length_bytes),
        "output": remote * t.bags * t.dim * (t.comm.a2a_fwd + t.comm.a2a_bwd),
    }


def row_wise_bytes(t: TableTraffic, id_bytes: int = INT64, length_bytes: int = INT32,
                   gloo: bool = False) -> Dict[str, float]:
    """RW pooled: lengths to all, ids to owners; reduce-scatter of [W*B, D] and all-gather back.

    gloo's reduce-scatter sends what its ring all-reduce does, 2(W-1)/W of the input (measured
    with ``comm_bytes``), twice NCCL's (W-1)/W.
    """
    w = t.world
    reduce_scatter = (2 if gloo else 1) * (w - 1) * t.bags * t.dim * t.comm.rs_fwd
    return {
        "input": (w - 1) * t.bags * length_bytes + (w - 1) / w * t.lookups * id_bytes,
        "output": reduce_scatter + (w - 1) * t.bags * t.dim * t.comm.rs_bwd,
    }


def data_parallel_bytes(t: TableTraffic) -> Dict[str, float]:
    """DP: a ring all-reduce of the whole table's gradient every step."""
    return {"sync": 2 * (t.world - 1) / t.world * t.rows * t.dim * FP32}


def stock_bytes(sharding_type: str, t: TableTraffic, num_column_shards: int = 1,
                id_bytes: int = INT64, length_bytes: int = INT32, gloo: bool = False) -> float:
    """Total bytes per rank per step of a stock sharding type (see the functions above).

    ``gloo``: price collectives as gloo implements them (only row-wise's reduce-scatter differs).
    """
    if sharding_type == TABLE_WISE:
        parts = table_wise_bytes(t, id_bytes, length_bytes)
    elif sharding_type == COLUMN_WISE:
        parts = column_wise_bytes(t, num_column_shards, id_bytes, length_bytes)
    elif sharding_type == ROW_WISE:
        parts = row_wise_bytes(t, id_bytes, length_bytes, gloo=gloo)
    elif sharding_type == DATA_PARALLEL:
        parts = data_parallel_bytes(t)
    else:
        raise ValueError(f"no byte model for sharding type {sharding_type!r}")
    return float(sum(parts.values()))


# -- frequency-hybrid ----------------------------------------------------------------------

def coverage_from_counts(counts: Sequence[float] | torch.Tensor, total: Optional[float] = None,
                         max_rows: Optional[int] = None) -> torch.Tensor:
    """``coverage[H]`` for H = 0..len from per-row counts (any order; sorted here).

    ``total`` is the table's total lookups (defaults to the sum of ``counts``; pass it when
    ``counts`` are only the top rows of a sketch).
    """
    c = torch.as_tensor(counts, dtype=torch.float64).flatten()
    c = torch.sort(c, descending=True).values
    if max_rows is not None:
        c = c[:max_rows]
    tot = float(c.sum()) if total is None else float(total)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(c, 0)])
    return (cum / tot).clamp_(0.0, 1.0) if tot > 0 else torch.zeros_like(cum)


def uniform_coverage(rows: int, max_rows: int) -> torch.Tensor:
    """Coverage if every row were equally likely (the no-statistics assumption)."""
    h = torch.arange(min(rows, max_rows) + 1, dtype=torch.float64)
    return h / max(rows, 1)


def hybrid_bytes(t: TableTraffic, coverage: torch.Tensor | float, hot_rows: torch.Tensor | int,
                 ) -> Dict[str, torch.Tensor]:
    """Frequency-hybrid bytes per rank per step, split by collective (module docstring).

    ``coverage`` and ``hot_rows`` may be tensors of the same shape (a whole curve at once).
    Returns {"lengths", "cold_ids", "partials"} and {"hot_sync"} (all in all-to-alls).
    """
    w = t.world
    cov = torch.as_tensor(coverage, dtype=torch.float64)
    h = torch.as_tensor(hot_rows, dtype=torch.float64)
    cold = (1.0 - cov).clamp(min=0.0)
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


def hybrid_total_bytes(t: TableTraffic, coverage, hot_rows) -> torch.Tensor:
    # every part is a tensor, so the sum is one (sum() starts from the int 0)
    return cast(torch.Tensor, sum(hybrid_bytes(t, coverage, hot_rows).values()))


def hybrid_cost_curve(t: TableTraffic, coverage: torch.Tensor, a2a_bw: float = 1.0,
                      hot_bw: float = 1.0) -> torch.Tensor:
    """Step cost (bytes / bandwidth) for H = 0 .. len(coverage)-1 hot rows."""
    h = torch.arange(coverage.numel(), dtype=torch.float64)
    parts = hybrid_bytes(t, coverage, h)
    a2a = parts["lengths"] + parts["cold_ids"] + parts["partials"]
    return a2a / a2a_bw + parts["hot_sync"] / hot_bw


def best_hot_rows(t: TableTraffic, coverage: torch.Tensor, max_rows: Optional[int] = None,
                  a2a_bw: float = 1.0, hot_bw: float = 1.0) -> int:
    """Brute-force argmin of :func:`hybrid_cost_curve` over H <= max_rows (ties: smaller H)."""
    curve = hybrid_cost_curve(t, coverage, a2a_bw, hot_bw)
    if max_rows is not None:
        curve = curve[: max(0, int(max_rows)) + 1]
    return int(torch.argmin(curve))


def hybrid_memory_bytes(t: TableTraffic, hot_rows: int, optimizer_bytes_per_row: int = 0,
                        cold_rows: Optional[int] = None, elem: int = FP32) -> int:
    """Per-rank memory: the hot replica (>= 1 row, no optimizer state: the owners update)
    + the cold block (``cold_rows``, default an even row-wise block) with its optimizer state;
    ``elem``: bytes per weight."""
    cold = math.ceil(t.rows / t.world) if cold_rows is None else cold_rows
    return max(hot_rows, 1) * t.dim * elem + cold * (t.dim * elem + optimizer_bytes_per_row)


def hybrid_step_buffer_bytes(t: TableTraffic, elem: int = FP32) -> int:
    """Per-rank memory of one step's buffers: the input ids (int64), the owner's ``[W*B, D]``
    partial sums and the ``[B, D]`` hot sums per feature."""
    return math.ceil(t.lookups * INT64 + (t.world + 1) * t.bags * t.dim * elem)


def stock_input_dists(types: Iterable[str]) -> int:
    """Stock KJTAllToAll input dists of a sharded module: one per sharding type in it, but
    data_parallel (none) and frequency_hybrid (its own cold all-to-all)."""
    return len(set(types) - {DATA_PARALLEL, FREQUENCY_HYBRID})


def module_overhead_bytes(world: int, types: Iterable[str], validate_ids: bool = True,
                          splits_per_dist: int = 3) -> float:
    """Per sharded module (its sharding ``types``) and step: the id-check verdicts + each stock
    KJTAllToAll's splits exchange (:func:`stock_input_dists`).

    The verdicts take 3 int64 per peer (as extra rows of a stock splits exchange, or an all-to-all
    of their own in a module of data_parallel tables only), or with a frequency-hybrid sharding
    in the module 4 int32 words per destination in its cold ids' header (whose per-table
    counts :func:`hybrid_bytes` prices), which also carries a spill flag and the rooms' pad of
    ``ROOM_PAD`` words per destination, checked or not.
    """
    types = set(types)
    hybrid = FREQUENCY_HYBRID in types
    per_peer = 4 * INT32 if hybrid else 3 * INT64
    check = (world - 1) * per_peer if validate_ids else 0
    # a hybrid module's cold ids' header holds a spill flag, and their rooms the pad (cold_all_to_all.py)
    rooms = (world - 1) * (1 + ROOM_PAD) * INT32 if hybrid else 0
    return float(check + rooms + stock_input_dists(types) * (world - 1) * splits_per_dist * INT64)


# -- per rank: what each rank sends, for plans with an owner per table or block -----------
#
# All ranks see batches from the same distribution, so a table costs every non-owner the
# same; what differs between ranks is what they own. Each function returns a ``[W]`` float64
# tensor of bytes sent per step by each rank (no module overhead; see
# :func:`module_overhead_rank_bytes`). Their mean over ranks equals the functions above.

def _rank_vector(world: int) -> torch.Tensor:
    return torch.zeros(world, dtype=torch.float64)


def table_wise_rank_bytes(t: TableTraffic, owner: int, id_bytes: int = INT64, length_bytes: int = INT32,
                          dim: Optional[int] = None) -> torch.Tensor:
    """TW on ``owner`` (or one column shard of width ``dim``): the owner sends the pooled
    vectors to every other rank; each other rank sends its ids and lengths and, in backward,
    its pooled gradient."""
    d = t.dim if dim is None else dim
    out = _rank_vector(t.world) + t.lookups * id_bytes + t.bags * length_bytes + t.bags * d * t.comm.a2a_bwd
    out[owner] = (t.world - 1) * t.bags * d * t.comm.a2a_fwd
    return out


def column_wise_rank_bytes(t: TableTraffic, owners: Sequence[int], dims: Sequence[int],
                           id_bytes: int = INT64, length_bytes: int = INT32) -> torch.Tensor:
    """CW: one table-wise exchange per column shard (ids to every shard's owner)."""
    out = _rank_vector(t.world)
    for owner, d in zip(owners, dims):  # plan-time loop over a table's column shards
        out += table_wise_rank_bytes(t, owner, id_bytes, length_bytes, dim=d)
    return out


def symmetric_rank_bytes(per_rank: float, world: int) -> torch.Tensor:
    """Row-wise and data-parallel: every rank sends the same (the mean)."""
    return _rank_vector(world) + per_rank


def hybrid_owner_hit(t: TableTraffic, coverage, shares: torch.Tensor) -> torch.Tensor:
    """P(a bag holds >= 1 cold id owned by rank j), ``[W]``: ``1 - (1 - (1-c) m_j)^L`` with
    ``m_j`` the owner's share of the table's cold lookups (ids of a bag independent)."""
    cold = max(0.0, 1.0 - float(coverage))
    return 1.0 - torch.pow(1.0 - cold * shares.to(torch.float64), t.pooling)


def hybrid_rank_bytes(t: TableTraffic, coverage, shares: torch.Tensor, hot_per_owner: torch.Tensor
                      ) -> torch.Tensor:
    """Frequency-hybrid with any cold layout: bytes each rank sends per step.

    ``shares[j]``: owner j's share of the table's cold lookups (sums to 1);
    ``hot_per_owner[j]``: hot rows owned (and sent every step) by rank j. Rank r sends
    - to each other owner j: the lengths of its bags with cold ids there, those ids (int32),
      in backward their partial sums' gradients, and the gradients of j's hot rows;
    - as an owner: its partial sums to every other rank, and its hot rows to every replica.
    """
    w = t.world
    cold = max(0.0, 1.0 - float(coverage))
    hit = hybrid_owner_hit(t, coverage, shares)  # [W]
    hot = hot_per_owner.to(torch.float64)
    fwd, bwd = t.comm.a2a_fwd, t.comm.a2a_bwd  # the output all-to-all's bytes per element
    to_owner = t.bags * hit * (INT32 * ROOM_SLACK + t.dim * bwd) \
        + t.lookups * cold * shares.to(torch.float64) * INT32 * ROOM_SLACK \
        + hot * t.dim * bwd  # what any rank sends to owner j (0 when j is itself)
    out = to_owner.sum() - to_owner  # to every owner but itself
    out += (w - 1) * (t.bags * hit * t.dim * fwd + hot * t.dim * fwd)
    return out


def hybrid_layout_bytes(t: TableTraffic, coverage, hot_rows, shares: torch.Tensor,
                        share_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean bytes per rank of a hybrid layout (for hot-set sizing: hot rows spread as the
    cold lookups are; ``coverage`` and ``hot_rows`` may be curves of the same shape).

    ``shares``: each owner's share of the cold lookups, or, with ``share_counts``, the
    distinct shares and how many owners have each (large W: ``[1/W]`` x W for even blocks).
    """
    w = t.world
    cov = torch.as_tensor(coverage, dtype=torch.float64)
    h = torch.as_tensor(hot_rows, dtype=torch.float64)
    cold = (1.0 - cov).clamp(min=0.0).unsqueeze(-1)
    m = shares.to(torch.float64)
    n = torch.ones_like(m) if share_counts is None else share_counts.to(torch.float64)
    hit_sum = ((1.0 - torch.pow(1.0 - cold * m, t.pooling)) * n).sum(-1)  # sum over owners of P(hit)
    remote = (w - 1) / w
    per_rank_bags = remote * t.bags * hit_sum  # bags sent to remote owners, per rank
    both = t.comm.a2a_fwd + t.comm.a2a_bwd  # the output all-to-all, forward + backward
    return (per_rank_bags * (INT32 * ROOM_SLACK + 2 * t.dim * (both / 2))
            + cold.squeeze(-1) * remote * t.lookups * INT32 * ROOM_SLACK
            + 2 * remote * h * t.dim * (both / 2) + (w - 1) * t.features * 2 * INT32)


def module_overhead_rank_bytes(world: int, types: Iterable[str], hybrid_features: int,
                               validate_ids: bool = True) -> torch.Tensor:
    """Per sharded module and step, every rank alike: :func:`module_overhead_bytes` plus the
    hybrid metadata's two int32 counts per hybrid feature and peer (which the mean model
    counts in :func:`hybrid_bytes`, the per-rank one here)."""
    per_module = module_overhead_bytes(world, types, validate_ids) + (world - 1) * hybrid_features * 2 * INT32
    return _rank_vector(world) + per_module


# -- compute per rank: what a rank does besides sending bytes ---------------------------
#
# A rank's step time is priced as bytes / bandwidth + a linear function of the work below
# (``ComputeCosts``, fitted from measured steps by ``benchmarks/calibrate.py``). Each work
# function returns ``[W, len(WORK_TERMS)]`` float64: per rank, forward + backward,
# - lookup: embedding elements gathered by a TBE (ids x dim; backward and the fused update
#   scale with it);
# - vector_stock / vector_hybrid: pooled-vector elements moved by the sharding's own ops
#   (stock: the pooled all-to-all's send and receive buffers, data-parallel: the dense
#   gradient; hybrid: partial sums packed, unpacked and added, hot rows copied W times and
#   the replica assembled);
# - ids_stock / ids_hybrid: ids handled outside the TBE (permutes, bucketize; hybrid: the
#   hot/cold split and the owner's received cold ids);
# - group_stock / group_hybrid: one per sharding group per step (the fixed cost of its
#   dispatched ops and host syncs; added per plan by ``plan_cost.plan_rank_work``).
WORK_TERMS = ("lookup", "vector_stock", "vector_hybrid", "ids_stock", "ids_hybrid", "group_stock", "group_hybrid")
_W = {name: i for i, name in enumerate(WORK_TERMS)}


def _work(world: int) -> torch.Tensor:
    return torch.zeros(world, len(WORK_TERMS), dtype=torch.float64)


def table_wise_rank_work(t: TableTraffic, owner: int, dim: Optional[int] = None) -> torch.Tensor:
    """TW on ``owner`` (or a column shard of width ``dim``): the owner looks up every rank's
    ids and sends W pooled blocks; every rank permutes its ids and receives its block."""
    d, w = (t.dim if dim is None else dim), t.world
    out = _work(w)
    out[:, _W["vector_stock"]] = t.bags * d
    out[:, _W["ids_stock"]] = t.lookups
    out[owner, _W["lookup"]] += w * t.lookups * d
    out[owner, _W["vector_stock"]] += w * t.bags * d
    out[owner, _W["ids_stock"]] += w * t.lookups
    return out


def column_wise_rank_work(t: TableTraffic, owners: Sequence[int], dims: Sequence[int]) -> torch.Tensor:
    out = _work(t.world)
    for owner, d in zip(owners, dims):  # plan-time loop over a table's column shards
        out += table_wise_rank_work(t, owner, dim=d)
    return out


def row_wise_rank_work(t: TableTraffic) -> torch.Tensor:
    """RW: each rank looks up its block's share of every rank's ids and reduce-scatters
    ``[W*B, D]``; every rank alike."""
    out = _work(t.world)
    out[:, _W["lookup"]] = t.lookups * t.dim
    out[:, _W["vector_stock"]] = (t.world + 1) * t.bags * t.dim
    out[:, _W["ids_stock"]] = 2 * t.lookups
    return out


def data_parallel_rank_work(t: TableTraffic) -> torch.Tensor:
    """DP: local lookups, and the whole table's dense gradient (all-reduce, update)."""
    out = _work(t.world)
    out[:, _W["lookup"]] = t.lookups * t.dim
    out[:, _W["vector_stock"]] = t.rows * t.dim
    out[:, _W["ids_stock"]] = t.lookups
    return out


# FBGEMM's CPU TBE backward has a vectorised path (SpMDM, the row-wise AdaGrad kernel) only for
# EXACT_ROWWISE_ADAGRAD on a table looked up by one feature. The owner that holds most of a one-hot
# table's cold rows (table-wise cold) looks each feature up as W virtual features of it
# (sharding/cells.py LaneLayout), which takes the scalar path: its extra backward per id, as a share
# of the one-feature lookup's forward + backward per id (``python -m benchmarks.tbe_paths``,
# benchmarks/results/tbe_paths.json; a test keeps the two equal). It is priced as that much more
# lookup work on such an owner (:func:`hybrid_rank_work`'s ``virtual``).
VIRTUAL_BACKWARD_EXTRA = 0.80


def hybrid_rank_work(t: TableTraffic, coverage, shares: torch.Tensor, hot_per_owner: torch.Tensor,
                     virtual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Frequency-hybrid with any cold layout (``shares`` / ``hot_per_owner`` as for
    :func:`hybrid_rank_bytes`): every rank routes its ids, moves the hot ones to the front
    (a fixed shape, no host sync) and pools them against the replica, assembles the replica
    and unpacks the partial sums it gets back; owner j looks up its share of every rank's
    cold ids and its hot rows, and packs partial sums and W copies of the rows. ``virtual``
    (bool ``[W]``, None: none): the owners that look the table up through virtual features on
    FBGEMM's scalar CPU backward, which costs :data:`VIRTUAL_BACKWARD_EXTRA` of their lookups
    more."""
    w, d = t.world, t.dim
    cov = float(coverage)
    cold = max(0.0, 1.0 - cov)
    hit = hybrid_owner_hit(t, coverage, shares)  # [W]
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


def hybrid_mean_work(t: TableTraffic, coverage, hot_rows, shares: torch.Tensor,
                     share_counts: Optional[torch.Tensor] = None,
                     virtual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over ranks of :func:`hybrid_rank_work` with hot rows spread as the cold lookups
    (for hot-set sizing; ``coverage`` and ``hot_rows`` may be curves): ``[..., len(WORK_TERMS)]``.
    ``virtual``: as for :func:`hybrid_rank_work`, per entry of ``shares``."""
    cov = torch.as_tensor(coverage, dtype=torch.float64)
    h = torch.as_tensor(hot_rows, dtype=torch.float64)
    cold = (1.0 - cov).clamp(min=0.0)
    m = shares.to(torch.float64)
    n = torch.ones_like(m) if share_counts is None else share_counts.to(torch.float64)
    hit_sum = ((1.0 - torch.pow(1.0 - cold.unsqueeze(-1) * m, t.pooling)) * n).sum(-1)
    out = torch.zeros(cov.shape + (len(WORK_TERMS),), dtype=torch.float64)
    out[..., _W["lookup"]] = t.lookups * t.dim * (cov.clamp(max=1.0) + cold) + h * t.dim / t.world
    if virtual is not None:  # the owners' lookups (cold ids, hot rows) through virtual features, over the ranks
        owned = (cold.unsqueeze(-1) * m * t.world * t.lookups + h.unsqueeze(-1) * m) * t.dim
        out[..., _W["lookup"]] += VIRTUAL_BACKWARD_EXTRA * (owned * virtual.to(torch.float64) * n).sum(-1) / t.world
    out[..., _W["vector_hybrid"]] = (2.0 * hit_sum + 1.0) * t.bags * t.dim + 2.0 * h * t.dim
    out[..., _W["ids_hybrid"]] = t.lookups * (1.0 + cold)
    return out


@dataclass(frozen=True)
class ComputeCosts:
    """Prices of the work terms (``WORK_TERMS``): ns per unit, and ms per sharding group.

    ``ns_per_byte`` is the CPU cost of a byte sent beyond the topology's bandwidth (0 when
    the bandwidth alone prices it). All zero: bytes and collectives only. ``collective_ms``:
    the fixed cost of one collective on the machine measured, fitted from its step times
    (None: the planner's default, ``plan_cost.DEFAULT_COLLECTIVE_MS``). ``busiest_share``:
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
