"""One cost model for every sharding option, stock and frequency_hybrid alike.

TorchRec's partitioner balances ranks by ``shard.perf`` and its planner picks the proposal
whose busiest rank is cheapest (with fitted prices that say ranks share cores, a blend of
the busiest and the mean rank: :class:`StepPerfModel`). If hybrid options were priced by
our model and stock ones by TorchRec's estimators, the comparison would mix units. Here
every option is priced from the same byte and compute models (``cost_model``), in the same
unit (ms):

- :func:`option_rank_cost` is the one dispatch from an option to the cost model: the bytes
  each rank sends and each rank's compute work (TBE lookups, the sharding's own vector and
  id work) for its table (:func:`traffic_of`: the option's traffic);
- :class:`BytesPerfEstimator` sets ``shard.perf`` for every option: the bytes that flow
  through the shard's owner per step (what it sends and what the others send it for this
  table), so the per-rank sums the partitioner balances add up to the plan's traffic;
- :func:`plan_rank_cost` (``plan_rank_bytes``, ``plan_rank_work``) adds them up for a
  partitioned plan, with each module's overhead bytes and a fixed work term per sharding
  group: what ``/proc/self/io`` measures, and the work ``cm.ComputeCosts`` prices;
- :func:`plan_cost` turns both into a step cost: the busiest rank's bytes / bandwidth +
  compute (blended with the mean rank's where the prices carry ``busiest_share``), plus a
  fixed cost per collective (:data:`COLLECTIVES_PER_STEP`), which is what
  makes a plan that mixes types pay for the extra collectives of each sharding it adds.

Quantized comms: each option's traffic carries the bytes per element its sharder's
``qcomm_codecs_registry`` puts on the pooled collectives (``cm.CommElems``, forward and
backward apart), read the way TorchRec's planner reads them (``SharderData.qcomm_dtype_sizes``;
estimators.py), so stock and hybrid options are priced with the same codecs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torchrec.distributed.planner.types import (ParameterConstraints, Perf, PerfModel, ShardEstimator,
                                              ShardingOption, Topology)

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner import hot_set
from torchrec_hybrid.types import FREQUENCY_HYBRID

# Collectives one sharding group issues per training step (forward + backward), counted on
# the code and TorchRec 1.8: table_wise / column_wise: KJTAllToAll's splits, lengths and
# values exchanges, the pooled all-to-all and its backward; row_wise: the same with a
# reduce-scatter and its all-gather; data_parallel: one DDP all-reduce bucket;
# frequency_hybrid: the cold ids' all-to-all (header and payload in one after the first step, a
# second on the rare step whose runs outgrow their rooms), output all-to-all and its backward.
COLLECTIVES_PER_STEP = {"table_wise": 5, "column_wise": 5, "table_column_wise": 5, "row_wise": 5,
                        "table_row_wise": 5, "grid_shard": 5, "data_parallel": 1, FREQUENCY_HYBRID: 3}
# Fixed cost of one collective, ms, where no fit gives one (~0.2 MB at 1 GiB/s). Measured on
# gloo over loopback it depends on the box: alone behind a barrier, 4 ranks on 2 cores took
# about 1-3 ms per small all-to-all (benchmarks/results/comm_floor.md), 2 ranks a tenth of
# that; inside a step it overlaps other ranks' compute, and the CPU fit puts it near 0
# (benchmarks/results/calibration.md).
DEFAULT_COLLECTIVE_MS = 0.2


FEATURE_BATCH_SIZES = "feature_batch_sizes"  # the attribute stamp_feature_batches sets on an option


def stamp_feature_batches(so: ShardingOption, constraints: Optional[Dict[str, ParameterConstraints]]) -> None:
    """Records on ``so`` what its constraints say of each feature's batch, as TorchRec's perf
    estimator reads them: ``batch_sizes`` (else the planner's batch) and ``num_poolings`` (the
    option's own first, ``shard_estimators.get_num_poolings``), so :func:`traffic_of` prices the
    same bags (an option cloned from this one keeps them)."""
    from torchrec.distributed.planner.shard_estimators import get_num_poolings

    c = (constraints or {}).get(so.name)
    n = len(so.input_lengths)
    sizes = list(c.batch_sizes) if c is not None and c.batch_sizes else [so.batch_size] * n
    if len(sizes) != n:
        raise ValueError(f"table '{so.name}': constraints batch_sizes has {len(sizes)} entries for its {n} "
                         "features (one per feature, as TorchRec's planner reads them)")
    so.num_poolings = list(get_num_poolings(constraints, so))
    setattr(so, FEATURE_BATCH_SIZES, sizes)


def traffic_of(so: ShardingOption, world_size: int, comm: cm.CommElems = cm.FP32_COMMS) -> cm.TableTraffic:
    """The cost model's view of a sharding option (``comm``: its sharder's quantized comms,
    ``estimators.comm_elems``): its bags per step summed over features - each feature's batch
    (``batch_sizes``) times its poolings per sample (``num_poolings``), as stamped by
    :func:`stamp_feature_batches`, else the planner's batch and one - and pooling the mean ids
    per bag over those bags."""
    lengths = list(so.input_lengths) or [1.0]
    feats = len(lengths)
    polls = so.num_poolings if so.num_poolings is not None and len(so.num_poolings) == feats else [1.0] * feats
    sizes = getattr(so, FEATURE_BATCH_SIZES, None) or [so.batch_size] * feats
    bags = [float(b) * p for b, p in zip(sizes, polls)]
    total = sum(bags)
    pooling = sum(length * b for length, b in zip(lengths, bags)) / total if total > 0 else sum(lengths) / feats
    return cm.TableTraffic(rows=so.tensor.shape[0], dim=so.tensor.shape[1], features=feats, pooling=pooling,
                           batch=total / feats, world=world_size, comm=comm)


@dataclass
class TrafficTable:
    """The workload the model prices: per table its traffic (pooling from the statistics),
    and per module type (``ShardingOption.module_type_key``) its sharder's quantized comms
    (``comms``; absent: fp32)."""

    traffic: Dict[str, cm.TableTraffic]
    gloo: bool = True
    comms: Dict[str, cm.CommElems] = field(default_factory=dict)
    # per module type: whether its sharder's fused optimizer has FBGEMM's vectorised CPU backward for a
    # table looked up by one feature (estimators.vectorised_cpu_backward; absent: no)
    vectorised: Dict[str, bool] = field(default_factory=dict)

    def scalar_virtual(self, so: ShardingOption) -> bool:
        """Whether an owner that looks ``so``'s table up through virtual features leaves FBGEMM's
        vectorised backward for its scalar path (on CPU only: :func:`virtual_owners`)."""
        return self.gloo and self.vectorised.get(so.module_type_key, False)

    def of(self, so: ShardingOption, world: int) -> cm.TableTraffic:
        t = self.traffic.get(so.name)
        t = t if t is not None else traffic_of(so, world)
        comm = self.comms.get(so.module_type_key)
        return t if comm is None or comm == t.comm else dataclasses.replace(t, comm=comm)


def column_sliced(so: ShardingOption) -> bool:
    """Whether a hybrid option is column-wise cold (shards are column slices, not row blocks)."""
    return so.sharding_type == FREQUENCY_HYBRID and any(s.offset[1] != 0 for s in so.shards)


def hybrid_bounds(so: ShardingOption, world: int, owner: Optional[int] = None) -> List[int]:
    """Row bounds of a row-laid hybrid option (table-wise cold: on ``owner``, default its shard's rank)."""
    from torchrec_hybrid.row_blocks import single_owner_bounds

    if len(so.shards) == 1:
        rank = owner if owner is not None else (so.shards[0].rank or 0)
        return single_owner_bounds(so.tensor.shape[0], world, rank)
    return [0] + [int(s.offset[0] + s.size[0]) for s in so.shards]


def hybrid_slices(so: ShardingOption, world: int, owner: Optional[int] = None) -> List[Tuple[int, List[int]]]:
    """``(width, row bounds)`` per column slice of a hybrid option: one slice of the full width
    for row layouts; for column-wise cold, every row of slice s on its shard's rank (``owner``
    while unplaced)."""
    if not column_sliced(so):
        return [(int(so.tensor.shape[1]), hybrid_bounds(so, world, owner))]
    rows = int(so.tensor.shape[0])
    out = []
    for s in so.shards:
        rank = (owner if s.rank is None else s.rank) or 0
        out.append((int(s.size[1]), [0] * (rank + 1) + [rows] * (world - rank)))
    return out


def _hybrid_loads(so: ShardingOption, t: cm.TableTraffic, world: int, owner: Optional[int] = None
                  ) -> List[Tuple[cm.TableTraffic, float, torch.Tensor, torch.Tensor]]:
    """Per column slice: (its traffic, coverage, owners' shares of its cold lookups, hot rows per owner)."""
    ch = so.hybrid_choice
    out = []
    for width, bounds in hybrid_slices(so, world, owner):
        shares, hot = hot_set.block_loads(ch.profile, ch.hot_rows, bounds)
        out.append((t if width == t.dim else dataclasses.replace(t, dim=width), ch.coverage, shares, hot))
    return out


def option_features(so: ShardingOption) -> Optional[int]:
    """How many features look the option's table up, from its module's config (None: not found).
    ``so.input_lengths`` tells only with per-feature statistics or constraints: TorchRec's
    enumerator gives a table without them one pooling factor, whatever its features."""
    module = so.module[1] if so.module else None
    configs = getattr(module, "embedding_bag_configs", None)
    for c in (configs() if callable(configs) else []):
        if c.name == so.name:
            return len(c.feature_names)
    return None


def virtual_owners(t: cm.TableTraffic, bounds: List[int], scalar_virtual: bool,
                   features: Optional[int] = None) -> Optional[torch.Tensor]:
    """The owners (bool ``[W]``) that look a table laid out in row blocks ``bounds`` up through
    virtual features on FBGEMM's scalar CPU backward, as the lookup builds them (lookup.py): the
    owners of most of its rows (``row_blocks.heavy_tables``) when the table has one feature (``features``,
    else ``t.features``: a table of several takes the scalar path in every layout) and one-id bags
    (multi-hot ones get a TBE call of their own, ``lookup.own_lane_pays``) and ``scalar_virtual``
    (:meth:`TrafficTable.scalar_virtual`); None when there are none."""
    from torchrec_hybrid.row_blocks import MULTI_HOT_POOLING, heavy_tables

    if not scalar_virtual or (t.features if features is None else features) != 1 or t.pooling >= MULTI_HOT_POOLING:
        return None
    heavy = heavy_tables(t.world, [b - a for a, b in zip(bounds, bounds[1:])], [t.rows] * t.world)
    return torch.tensor(heavy, dtype=torch.bool) if any(heavy) else None


def option_virtual_owners(so: ShardingOption, t: cm.TableTraffic, bounds: List[int],
                          scalar_virtual: bool) -> Optional[torch.Tensor]:
    """:func:`virtual_owners` of an option's table laid out in ``bounds``: its features counted from its
    module's config (:func:`option_features`), and only for fp32 weights (FBGEMM's vectorised backward
    needs them: other tables take the scalar path in every layout)."""
    if not scalar_virtual or so.tensor.dtype != torch.float32:
        return None
    return virtual_owners(t, bounds, True, option_features(so))


def option_rank_cost(so: ShardingOption, t: cm.TableTraffic, world: int, gloo: bool = True,
                     owner: Optional[int] = None, scalar_virtual: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bytes each rank sends (``[W]``) and each rank's compute work (``[W, len(WORK_TERMS)]``)
    per step for this option's table: the one dispatch from a sharding type to the cost
    model. Owners are the shards' ranks (or ``owner`` for a one-shard option not yet placed);
    ``scalar_virtual``: :meth:`TrafficTable.scalar_virtual` of the option (:func:`option_virtual_owners`)."""
    st = so.sharding_type
    if st == FREQUENCY_HYBRID:  # column-wise cold: the sum of its slices, each laid out table-wise
        loads = _hybrid_loads(so, t, world, owner)  # per slice, in hybrid_slices' order
        virtual = [option_virtual_owners(so, x[0], bounds, scalar_virtual)
                   for x, (_, bounds) in zip(loads, hybrid_slices(so, world, owner))]
        return (sum(cm.hybrid_rank_bytes(*x) for x in loads),  # type: ignore[return-value]
                sum(cm.hybrid_rank_work(*x, virtual=v) for x, v in zip(loads, virtual)))
    if st == cm.TABLE_WISE:
        rank = owner if owner is not None else (so.shards[0].rank or 0)
        return cm.table_wise_rank_bytes(t, rank), cm.table_wise_rank_work(t, rank)
    if st in (cm.COLUMN_WISE, "table_column_wise"):
        owners = [(owner if s.rank is None else s.rank) or 0 for s in so.shards]
        dims = [s.size[1] for s in so.shards]
        return cm.column_wise_rank_bytes(t, owners, dims), cm.column_wise_rank_work(t, owners, dims)
    if st in (cm.ROW_WISE, "table_row_wise", "grid_shard"):
        return cm.symmetric_rank_bytes(cm.stock_bytes(cm.ROW_WISE, t, gloo=gloo), world), cm.row_wise_rank_work(t)
    if st == cm.DATA_PARALLEL:
        return cm.symmetric_rank_bytes(cm.stock_bytes(st, t), world), cm.data_parallel_rank_work(t)
    raise ValueError(f"table {so.name!r}: no cost model for sharding type {st!r}")


def option_mean_bytes(so: ShardingOption, world_size: int) -> Optional[float]:
    """Mean bytes per rank per step of one planned option, as the hot-set sizing priced it
    (hybrid: its cold layout's, ``HotSetChoice.bytes_per_step``); None: type not modelled."""
    choice = getattr(so, "hybrid_choice", None)
    if so.sharding_type == FREQUENCY_HYBRID and choice is not None:
        return float(choice.bytes_per_step)
    try:
        return cm.stock_bytes(so.sharding_type, traffic_of(so, world_size), num_column_shards=len(so.shards))
    except ValueError:
        return None


def sharding_groups(options: Iterable[ShardingOption]) -> Dict[str, set]:
    """Sharding types per module path (each is one sharding group with its own collectives)."""
    out: Dict[str, set] = {}
    for so in options:
        out.setdefault(so.path, set()).add(so.sharding_type)
    return out


def plan_rank_cost(options: List[ShardingOption], traffic: TrafficTable, world: int,
                   validate_ids: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Bytes each rank sends and each rank's compute work per step under a partitioned plan:
    its tables' (:func:`option_rank_cost`) plus, per module, the overhead bytes and one fixed
    work term per sharding group (stock types, hybrid)."""
    sent = torch.zeros(world, dtype=torch.float64)
    work = torch.zeros(world, len(cm.WORK_TERMS), dtype=torch.float64)
    for so in options:
        b, w = option_rank_cost(so, traffic.of(so, world), world, traffic.gloo,
                                scalar_virtual=traffic.scalar_virtual(so))
        sent += b
        work += w
    for path, types in sharding_groups(options).items():
        hybrid_features = sum(traffic.of(so, world).features for so in options
                              if so.path == path and so.sharding_type == FREQUENCY_HYBRID)
        sent += cm.module_overhead_rank_bytes(world, types, hybrid_features, validate_ids)
        work[:, cm.WORK_TERMS.index("group_stock")] += len(types - {FREQUENCY_HYBRID})
        work[:, cm.WORK_TERMS.index("group_hybrid")] += int(FREQUENCY_HYBRID in types)
    return sent, work


def plan_rank_bytes(options: List[ShardingOption], traffic: TrafficTable, world: int,
                    validate_ids: bool = True) -> torch.Tensor:
    """Bytes each rank sends per step under a partitioned plan, module overheads included."""
    return plan_rank_cost(options, traffic, world, validate_ids)[0]


def plan_rank_memory(options: List[ShardingOption], world: int, on_device: bool) -> torch.Tensor:
    """Memory each rank holds under a partitioned plan, bytes: its shards' storage (what the
    partitioner counted: HBM on a GPU, else DDR) plus what a frequency_hybrid table puts on the
    ranks its shards do not cover - every rank holds the table's full hot replica and pools its
    own lookups, but a table-wise (column-wise) cold option's shards count the replica (its
    slice's width of it) on the owner (slice owners) alone: the rest of the replica, the step's
    buffers and the one cold row a non-owner keeps (row_blocks.py)."""
    mem = torch.zeros(world, dtype=torch.float64)
    for so in options:
        widths = torch.zeros(world, dtype=torch.float64)
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
        t = traffic_of(so, world)
        mem += missing * max(choice.hot_rows, 1) * elem
        mem += uncovered * (cm.hybrid_step_buffer_bytes(t, elem) + dim * elem)
    return mem


def plan_rank_work(options: List[ShardingOption], traffic: TrafficTable, world: int) -> torch.Tensor:
    """Compute work of each rank per step under a partitioned plan, ``[W, len(WORK_TERMS)]``."""
    return plan_rank_cost(options, traffic, world)[1]


def collectives_per_step(options: List[ShardingOption]) -> int:
    """Collectives a plan issues per step (per module: each sharding group's own), plus, for a
    module of data_parallel tables alone, the small all-to-all of its id-check verdicts (other
    modules' verdicts ride a split-size exchange they make anyway; sharded_ebc.py)."""
    n = 0
    for types in sharding_groups(options).values():
        n += sum(COLLECTIVES_PER_STEP.get(t, 5) for t in types)
        if not cm.stock_input_dists(types) and FREQUENCY_HYBRID not in types:
            n += 1  # the id check's own all-to-all (else it rides the hybrid metadata or a stock splits exchange)
    return n


def plan_cost(options: List[ShardingOption], traffic: TrafficTable, topology: Topology,
              collective_ms: float = DEFAULT_COLLECTIVE_MS, compute: Optional[cm.ComputeCosts] = None
              ) -> Dict[str, float]:
    """Step cost of a partitioned plan: the busiest rank's bytes / bandwidth + its compute
    (``compute`` prices, cost_model.py; None: none; where the prices say ranks share cores,
    blended with the mean rank's, ``ComputeCosts.step_ms``), + a fixed cost per collective."""
    from torchrec_hybrid.planner.estimators import bandwidths

    w = topology.world_size
    per_rank, work = plan_rank_cost(options, traffic, w)
    n = collectives_per_step(options)
    bw = bandwidths(topology)["a2a"]
    work_ms = compute.ms(work, per_rank) if compute else torch.zeros(w)
    rank_ms = per_rank / bw + work_ms
    busiest = int(torch.argmax(rank_ms))
    step = float(compute.step_ms(rank_ms)) if compute else float(rank_ms[busiest])
    return {"cost_ms": step + n * collective_ms, "busiest_bytes": float(per_rank.max()),
            "mean_bytes": float(per_rank.mean()), "collectives": float(n),
            "compute_ms": float(work_ms[busiest]), "bytes_ms": float(per_rank[busiest]) / bw}


class BytesPerfEstimator(ShardEstimator):
    """``shard.perf`` of every option from the byte and compute models (module docstring).

    A shard's comms are the traffic of its table that passes through its owner: what the
    owner sends plus what the other ranks send it; its compute, the work of its table on its
    owner (and, for one-shard options, on every rank: it all exists because of this shard).
    One-shard options (table_wise, hybrid with table-wise cold) are priced as if on rank 0:
    by symmetry any owner costs the same.
    """

    def __init__(self, topology: Topology, traffic: TrafficTable, compute: Optional[cm.ComputeCosts] = None) -> None:
        self._topology = topology
        self._traffic = traffic
        self._compute = compute

    def estimate(self, sharding_options, sharder_data_map=None, sharder_map=None) -> None:
        from torchrec_hybrid.planner.estimators import bandwidths, comm_elems, fused_params, vectorised_cpu_backward

        w = self._topology.world_size
        bw = bandwidths(self._topology)["a2a"]
        for so in sharding_options:
            t = self._traffic.of(so, w)
            comm = comm_elems(sharder_data_map, so)  # the sharder's quantized comms, as TorchRec reads them
            if comm is not None and comm != t.comm:
                t = dataclasses.replace(t, comm=comm)
            single = len(so.shards) == 1
            scalar = self._traffic.gloo and vectorised_cpu_backward(fused_params(sharder_data_map, so))
            sent, work = option_rank_cost(so, t, w, self._traffic.gloo, owner=0 if single else None,
                                          scalar_virtual=scalar)
            ms = None if self._compute is None else self._compute.ms(work, sent)
            for i, shard in enumerate(so.shards):
                fwd = 0.0 if ms is None else self._shard_ms(so, t, i, ms, single)
                comms = shard_traffic(so, t, w, i, sent) / bw
                shard.perf = Perf(fwd_compute=fwd, fwd_comms=comms, bwd_compute=0.0, bwd_comms=0.0)

    def _shard_ms(self, so: ShardingOption, t: cm.TableTraffic, index: int, ms: torch.Tensor, single: bool) -> float:
        """Compute ms of shard ``index`` of ``so``, whose ranks cost ``ms`` (``[W]``): all of it for a
        one-shard option; a stock column shard, its own table-wise exchange on one rank (a table may
        have more column shards than there are ranks, and unplaced ones all sit on rank 0 in ``ms``,
        as :func:`shard_traffic` prices their bytes); a row-laid hybrid shard, its rank's; else (row
        blocks, replicas, hybrid column slices: every shard alike) an even share."""
        assert self._compute is not None
        if single:
            return float(ms.sum())
        if so.sharding_type in (cm.COLUMN_WISE, "table_column_wise"):
            dim = so.shards[index].size[1]
            work, sent = cm.table_wise_rank_work(t, 0, dim=dim), cm.table_wise_rank_bytes(t, 0, dim=dim)
            return float(self._compute.ms(work, sent).sum())
        if so.sharding_type == FREQUENCY_HYBRID and not column_sliced(so):
            return float(ms[index])
        return float(ms.sum()) / len(so.shards)


def shard_traffic(so: ShardingOption, t: cm.TableTraffic, world: int, index: int, sent: torch.Tensor) -> float:
    """Bytes per step passing through the owner of shard ``index`` (sent by it, or to it);
    ``sent``: the option's bytes per rank (:func:`option_rank_cost`, one-shard options on rank 0)."""
    st = so.sharding_type
    if st == cm.TABLE_WISE or (st == FREQUENCY_HYBRID and len(so.shards) == 1):
        return float(sent.sum())
    if st in (cm.COLUMN_WISE, "table_column_wise"):
        return float(cm.table_wise_rank_bytes(t, 0, dim=so.shards[index].size[1]).sum())
    if column_sliced(so):  # slice `index`'s traffic, wherever it is placed
        return float(cm.hybrid_rank_bytes(*_hybrid_loads(so, t, world, owner=0)[index]).sum())
    if st == FREQUENCY_HYBRID:
        _, cov, shares, hot = _hybrid_loads(so, t, world)[0]
        own = torch.zeros(world, dtype=torch.float64)
        own[index] = 1.0
        # what rank `index` sends as owner + what each other rank sends to it
        return float(cm.hybrid_rank_bytes(t, cov, shares * own, hot * own).sum())
    return float(sent.sum()) / max(1, len(so.shards))


class StepPerfModel(PerfModel):
    """Rates a proposal as TorchRec's ``NoopPerfModel`` does (each rank's summed shard perf),
    but blends the busiest rank with the mean rank as the prices say (``ComputeCosts.step_ms``):
    an approximation of :func:`plan_cost`'s blend (shard perf puts a one-shard option's work
    on its owner and leaves out module overheads). With ``busiest_share`` 1 it is
    ``NoopPerfModel``."""

    def __init__(self, topology: Topology, compute: cm.ComputeCosts) -> None:
        self._topology = topology
        self._compute = compute

    def rate(self, plan: List[ShardingOption]) -> float:
        perfs = torch.zeros(self._topology.world_size, dtype=torch.float64)
        for so in plan:
            for shard in so.shards:
                perfs[shard.rank] += shard.perf.total  # type: ignore[union-attr, index]
        return float(self._compute.step_ms(perfs))
