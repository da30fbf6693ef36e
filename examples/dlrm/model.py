"""Model side of the DLRM example: DLRM, its sharding plan, DMP and the optimizers.

- ``build_model``: ``torchrec.models.dlrm.DLRM`` (embedding tables on the meta device, so
  DMP allocates only each rank's shards) wrapped in ``DLRMTrain`` (adds the BCE loss).
- ``build_plan``: one of three planners (``sharding.planner``):
  ``hybrid``  ``torchrec_hybrid.planner.HybridEmbeddingShardingPlanner`` fed with the
              frequency statistics: it picks each table's sharding type and the hot set of
              each hybrid table (options under ``sharding.hot_set``);
  ``manual``  every table ``frequency_hybrid`` (hot rows replicated, cold rows row-wise);
  ``stock``   TorchRec's ``EmbeddingShardingPlanner`` with the stock sharder (comparison).
  The hybrid and stock planners price bytes on the network of ``sharding.network``: measured
  on the process group first (``measure``, default), the topology's own bandwidths, or a given
  one; ``plan_summary`` says in one line which plan the run trains and why.
- ``build_optimizer``: every embedding table gets the same optimizer whatever its sharding:
  FBGEMM's fused one (applied in backward) for sharded tables, the same algorithm as a torch
  optimizer (``torchrec.optim.RowWiseAdagrad`` for ``rowwise_adagrad``) for data-parallel
  tables (DDP gives them the gradient a sharded table's kernel sees: the same state after
  the same steps, ``tests/examples``). The MLPs get ``optim.dense``. So a table trains the same way under
  any plan, and its optimizer state (one accumulator per row) maps between plans.
- ``init_embeddings``: every table's initial weights are a function of (seed, table, row,
  column) only, so two plans start from the same model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import CollectiveType
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torch.distributed._shard.sharded_tensor import ShardedTensor

from examples.dlrm.data import _hash_uniform
from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder, _compat, frequency_hybrid
from torchrec_hybrid.planner.config import parse_hot_set, parse_table_constraints
from torchrec_hybrid.planner.network import NetworkMeasurement, measure_network
from torchrec_hybrid.planner.planner import HybridEmbeddingShardingPlanner, PlanCandidate, without_hybrid
from torchrec_hybrid.planner.topology import UniformCommsBandwidth, gbps_to_bytes_per_ms, gloo_topology
from torchrec_hybrid.stats import FrequencyStats, HotSetRule

logger = logging.getLogger(__name__)

EBC_PATH = "model.sparse_arch.embedding_bag_collection"  # DLRMTrain -> DLRM -> SparseArch -> EBC

EMB_OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}
# the same algorithms as torch optimizers, for data-parallel tables (FBGEMM's fused kernels
# need a sharded table); their per-row state is named as the fused optimizer names it
REPLICATED_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad}
TORCH_TO_FUSED_STATE = {"sum": "momentum1"}
DENSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def build_model(cfg, tables: List[EmbeddingBagConfig]) -> DLRMTrain:
    m = cfg.model
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                dense_arch_layer_sizes=list(m.dense_arch), over_arch_layer_sizes=list(m.over_arch),
                dense_device=torch.device("cpu"))
    return DLRMTrain(dlrm)


def fused_params(cfg) -> Dict:
    o = cfg.optim.embedding
    if o.optimizer not in EMB_OPTIMIZERS:
        raise ValueError(f"optim.embedding.optimizer must be one of {list(EMB_OPTIMIZERS)}")
    out = {"optimizer": EMB_OPTIMIZERS[o.optimizer], "learning_rate": float(o.lr)}
    if o.optimizer != "sgd":
        out["eps"] = float(o.eps)
    return out


def hot_set_rule(cfg) -> HotSetRule:
    """The manual planner's rule (``sharding.manual_hot_set``: exactly one key is set)."""
    h = {k: v for k, v in dataclasses.asdict(cfg.sharding.manual_hot_set).items() if v is not None}
    if "memory_budget_bytes" in h:
        h.setdefault("optimizer", cfg.optim.embedding.optimizer)
    return HotSetRule(**h)


def _topology(world_size: int, device: torch.device, bandwidth_gbps: Optional[float] = None) -> Topology:
    """The topology the planners start from: on CPU ``gloo_topology`` (gloo: one bandwidth for every
    collective; TorchRec's defaults describe NVLink), else TorchRec's default one; ``bandwidth_gbps``
    (``sharding.network`` given as a number): every collective at that many GiB/s per rank, any device."""
    # ranks per host, as torchrun sets it; a multi-node job is planned as several hosts
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cpu":
        if bandwidth_gbps is not None:
            return gloo_topology(world_size, bandwidth_gbps=bandwidth_gbps, local_world_size=local)
        return gloo_topology(world_size, local_world_size=local)
    comms = UniformCommsBandwidth(gbps_to_bytes_per_ms(bandwidth_gbps)) if bandwidth_gbps is not None else None
    return Topology(world_size=world_size, local_world_size=local, compute_device=device.type,
                    generalized_comms_bandwidths=comms)


def planning_network(cfg, pg: dist.ProcessGroup) -> Optional[NetworkMeasurement]:
    """``sharding.network: measure``: the process group's collectives measured (``measure_network``,
    about a second; collective, every rank gets the same measurement), once, for whichever of the
    hybrid and stock planners plans, so the two price bytes alike and the hybrid planner's own copy
    of TorchRec's plan is priced as ``--planner stock`` plans it. None for the other settings, and for
    the manual planner, which prices nothing (said in the log)."""
    network = cfg.sharding.network
    if cfg.sharding.planner == "manual":
        logger.info("sharding.network %r: not used by the manual planner (it prices no plan)", network)
        return None
    if network != "measure":
        return None
    measurement = measure_network(pg)
    logger.info("sharding.network measure: %s", measurement)
    return measurement


@dataclasses.dataclass
class PlanResult:
    """What :func:`build_plan` made: the plan and its sharder, the planner that made it (``name``:
    hybrid / stock / manual; ``planner``: None for manual) and the network it was priced on
    (``measurement`` where ``sharding.network`` is ``measure``)."""

    plan: ShardingPlan
    sharder: ModuleSharder
    name: str
    planner: Any
    measurement: Optional[NetworkMeasurement] = None
    network_setting: Any = "topology"  # sharding.network as configured


def build_plan(cfg, model: torch.nn.Module, stats: Optional[FrequencyStats], hot_ids: Dict[str, torch.Tensor],
               world_size: int, device: torch.device, pg: dist.ProcessGroup) -> PlanResult:
    """The plan of ``sharding.planner`` (collective: every rank calls it).

    ``hybrid``: the planner picks each table's type and, for hybrid tables, its hot set
    (carried in the plan) from the statistics. ``manual``: every table ``frequency_hybrid``
    with ``hot_ids`` (from ``sharding.manual_hot_set``). ``stock``: TorchRec's planner and sharder.
    The hybrid and stock planners plan for the network of ``sharding.network`` (:func:`planning_network`):
    the hybrid planner given the measurement (``network=``), TorchRec's given the topology with its
    bandwidths (``NetworkMeasurement.apply_to``), the same network either way.
    """
    kind = cfg.sharding.planner
    fp = fused_params(cfg)
    network = cfg.sharding.network
    topology = _topology(world_size, device, None if isinstance(network, str) else float(network))
    measurement = planning_network(cfg, pg)
    constraints = parse_table_constraints(cfg.sharding.tables, "sharding.tables") or None
    if kind == "stock":
        sharder = EmbeddingBagCollectionSharder(fused_params=fp)
        planner = EmbeddingShardingPlanner(
            topology=measurement.apply_to(topology) if measurement is not None else topology,
            batch_size=cfg.data.batch_size, constraints=without_hybrid(constraints))
        return PlanResult(planner.collective_plan(model, [sharder], pg), sharder, "stock", planner, measurement,
                          network)
    if kind not in ("hybrid", "manual"):
        raise ValueError(f"sharding.planner must be hybrid, stock or manual, got {kind!r}")
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids=hot_ids, fused_params=fp)
    if kind == "hybrid":
        opts = parse_hot_set(cfg.sharding.hot_set, "sharding.hot_set")  # same keys as configs/planner.yaml
        planner = HybridEmbeddingShardingPlanner(topology=topology, batch_size=cfg.data.batch_size,
                                                 frequency_stats=stats, constraints=constraints,
                                                 network=measurement, **opts)
        return PlanResult(planner.collective_plan(model, [sharder], pg), sharder, "hybrid", planner, measurement,
                          network)
    ebc = model.model.sparse_arch.embedding_bag_collection
    gens = {c.name: frequency_hybrid() if c.num_embeddings >= world_size else  # no empty cold row block
            frequency_hybrid(cold="table_wise", rank=0) for c in ebc.embedding_bag_configs()}
    plan = construct_module_sharding_plan(ebc, gens, sharder=sharder, local_size=world_size,
                                          world_size=world_size, device_type=device.type)
    return PlanResult(ShardingPlan({EBC_PATH: plan}), sharder, "manual", None, None, network)


def planned_hot_ids(plan: ShardingPlan, sharder_hot_ids: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Hot ids of every ``frequency_hybrid`` table as the sharded model will use them."""
    out: Dict[str, torch.Tensor] = {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.sharding_type == FREQUENCY_HYBRID:
                ids = getattr(ps, "hot_ids", None)  # a plan may carry them; they win
                out[name] = ids if ids is not None else sharder_hot_ids.get(name, torch.empty(0, dtype=torch.int64))
    return out


def shard_model(model: torch.nn.Module, plan: ShardingPlan, sharder: ModuleSharder,
                device: torch.device) -> DistributedModelParallel:
    return DistributedModelParallel(module=model, device=device, plan=plan, sharders=[sharder])


@dataclasses.dataclass
class Optimizers:
    """The training optimizer (``combined``, what the pipeline steps) and its parts."""

    combined: CombinedOptimizer
    fused: CombinedOptimizer                 # FBGEMM, sharded tables (DMP's fused_optimizer)
    dense: KeyedOptimizerWrapper             # optim.dense over the MLPs
    replicated: Optional[KeyedOptimizerWrapper]  # optim.embedding over data-parallel tables
    embedding_optimizer: str


def _embedding_kwargs(cfg) -> Dict[str, float]:
    o = cfg.optim.embedding
    kwargs = {"lr": float(o.lr)}
    if o.optimizer != "sgd":
        kwargs["eps"] = float(o.eps)
    return kwargs


def build_optimizer(cfg, model: DistributedModelParallel) -> Optimizers:
    """The fused embedding optimizer, the same algorithm over data-parallel tables, and the
    dense optimizer over the MLPs, combined as in TorchRec's DLRM example."""
    o = cfg.optim.dense
    if o.optimizer not in DENSE_OPTIMIZERS:
        raise ValueError(f"optim.dense.optimizer must be one of {list(DENSE_OPTIMIZERS)}, got {o.optimizer!r}")
    emb = cfg.optim.embedding.optimizer
    if emb not in REPLICATED_OPTIMIZERS:
        raise ValueError(f"optim.embedding.optimizer must be one of {list(REPLICATED_OPTIMIZERS)}, got {emb!r}")
    params = dense_parameters(model)
    mlp = {n: p for n, p in params.items() if "embedding_bag_collection" not in n}
    tables = {n: p for n, p in params.items() if "embedding_bag_collection" in n}
    kwargs: Dict[str, Any] = {"lr": float(o.lr)}
    if o.optimizer in ("adagrad", "adam"):
        kwargs["eps"] = float(o.eps)
    opt_cls = DENSE_OPTIMIZERS[o.optimizer]
    dense_opt = KeyedOptimizerWrapper(mlp, lambda ps: opt_cls(ps, **kwargs))
    parts: List[Any] = [model.fused_optimizer, dense_opt]
    replicated = None
    if tables:
        # measured: the gradient DDP gives a data-parallel table equals the one a sharded
        # table's fused optimizer sees (the same optimizer state after the same steps)
        rep_cls = REPLICATED_OPTIMIZERS[emb]
        emb_kwargs = _embedding_kwargs(cfg)
        replicated = KeyedOptimizerWrapper(tables, lambda ps: rep_cls(ps, **emb_kwargs))
        parts.append(replicated)
    return Optimizers(CombinedOptimizer(parts), model.fused_optimizer, dense_opt, replicated, emb)


def _init_values(rows: torch.Tensor, cols: torch.Tensor, dim: int, num_rows: int, salt: int) -> torch.Tensor:
    """Uniform(-1/sqrt(rows), 1/sqrt(rows)) (TorchRec's default), from a hash of the position."""
    pos = rows.view(-1, 1) * dim + cols.view(1, -1)
    bound = math.sqrt(1.0 / num_rows)
    return ((2.0 * _hash_uniform(pos, salt) - 1.0) * bound).float()


# init_embeddings fills a shard this many elements at a time: whole 200k x 128 shards (configs/dlrm_mlperf.yaml)
# held a few hundred MB of hash temporaries each, at the run's peak memory
INIT_CHUNK_ELEMENTS = 1 << 22


def init_embeddings(model: DistributedModelParallel, tables: List[EmbeddingBagConfig], seed: int) -> None:
    """Sets every table's weights to a function of (seed, table, row, column): plan-independent.

    Each rank computes only its own shards (vectorised), then loads them the way a
    checkpoint is loaded (``load_state_dict``), so any sharding type takes them.
    """
    sd = model.state_dict()
    for i, t in enumerate(tables):
        key = f"{EBC_PATH}.embedding_bags.{t.name}.weight"
        value = sd[key]
        salt = (int(seed) + 1) * 1_000_003 + i
        pieces = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                  if isinstance(value, ShardedTensor) else [(value, [0, 0])])
        for tensor, (r0, c0) in pieces:
            if tensor.numel() == 0:
                continue
            cols = torch.arange(c0, c0 + tensor.shape[1], dtype=torch.int64)
            step = max(1, INIT_CHUNK_ELEMENTS // tensor.shape[1])  # the hash's int64 temporaries: ~8 x a chunk
            for start in range(0, tensor.shape[0], step):
                rows = torch.arange(r0 + start, r0 + min(start + step, tensor.shape[0]), dtype=torch.int64)
                with torch.no_grad():
                    tensor[start:start + step].copy_(
                        _init_values(rows, cols, t.embedding_dim, t.num_embeddings, salt).to(tensor.device))
    model.load_state_dict(sd)


def replicated_tables(plan: ShardingPlan) -> List[str]:
    return [n for mp in plan.plan.values() for n, ps in mp.items()  # type: ignore[union-attr]
            if ps.sharding_type == "data_parallel"]


STATE_BYTES_PER_ROW = {"sgd": lambda dim: 0, "adagrad": lambda dim: 4 * dim, "rowwise_adagrad": lambda dim: 4}


def plan_table(plan: ShardingPlan, tables: List[EmbeddingBagConfig], hot_ids: Dict[str, torch.Tensor],
               stats: Optional[FrequencyStats], world_size: int, optimizer: str,
               rank_bytes: Optional[List[float]] = None) -> List[str]:
    """Lines of a table of the plan: per table its type, ranks, hot rows and the share of
    the counted lookups they serve; per rank the weight + optimizer memory of its shards
    (hot replicas included) and, where the planner gives it, its modelled bytes per step."""
    by_name = {t.name: t for t in tables}
    memory = [0.0] * world_size
    lines = [f"{'table':<10} {'type':<17} {'rows':>9} {'ranks':<10} {'hot rows':>8} {'hot cover':>9}"]
    for module_plan in plan.plan.values():
        for name, ps in sorted(module_plan.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[-1])  # type: ignore
                               if kv[0].rsplit("_", 1)[-1].isdigit() else 0):
            t = by_name.get(name)
            if t is None:
                continue
            row_bytes = 4 * t.embedding_dim + STATE_BYTES_PER_ROW[optimizer](t.embedding_dim)
            if ps.sharding_type == "data_parallel" or ps.sharding_spec is None:
                for r in (ps.ranks or range(world_size)):
                    memory[r] += t.num_embeddings * row_bytes
            else:
                for shard in ps.sharding_spec.shards:  # type: ignore[attr-defined]
                    r = shard.placement.rank()
                    memory[r] += shard.shard_sizes[0] * shard.shard_sizes[1] / t.embedding_dim * row_bytes
            hot = hot_ids.get(name)
            n_hot = int(hot.numel()) if hot is not None else 0
            if n_hot:  # hot replicas: weights on every rank
                for r in range(world_size):
                    memory[r] += n_hot * 4 * t.embedding_dim
            cover = "-"
            if stats is not None and stats.is_exact(name) and stats.lookups(name):
                if ps.sharding_type == "data_parallel":
                    cover = "1.000"
                elif n_hot:
                    cover = f"{float(stats.counts(name)[hot].sum()) / stats.lookups(name):.3f}"
            ranks = ps.ranks or []
            rank_text = "all" if len(ranks) == world_size else ",".join(map(str, ranks))
            lines.append(f"{name:<10} {ps.sharding_type:<17} {t.num_embeddings:>9} {rank_text:<10} "
                         f"{n_hot:>8} {cover:>9}")
    for r in range(world_size):
        est = f", modelled {rank_bytes[r] / 1e6:.3f} MB sent/step" if rank_bytes and r < len(rank_bytes) else ""
        lines.append(f"rank {r}: {memory[r] / 2**20:.2f} MiB embedding weights + optimizer state{est}")
    return lines


def network_fields(setting: Any, used: bool, measurement: Optional[NetworkMeasurement]) -> Dict[str, Any]:
    """The final JSON's ``network``: ``sharding.network`` as set, whether a planner priced with it
    (the manual planner does not), and, where measured, what ``measure_network`` found (bandwidths
    in bytes/ms per rank, TorchRec's unit)."""
    out: Dict[str, Any] = {"setting": setting, "used": used}
    if measurement is not None:
        out.update(backend=measurement.backend, bandwidth=measurement.bandwidth,
                   bandwidth_gbps=measurement.bandwidth_gbps, allreduce_bandwidth=measurement.allreduce_bandwidth,
                   collective_ms=measurement.collective_ms, elapsed_s=measurement.elapsed_s)
    return out


# the hybrid planner's candidates (PlanCandidate.name) as the plan line names them
CANDIDATE_LABELS = {
    "stock: TorchRec's EmbeddingShardingPlanner": "TorchRec's plan",
    "hybrid planner: stock + hybrid options": "the partitioner's mix",
    "every eligible table frequency_hybrid": "the all-hybrid candidate",
}


def _is_stock(candidate: PlanCandidate) -> bool:
    return candidate.name.startswith("stock")  # how the hybrid planner tells TorchRec's plan among its candidates


def plan_types_text(plan: ShardingPlan, sharder_hot_ids: Optional[Dict[str, torch.Tensor]] = None) -> str:
    """``"15 frequency_hybrid with 2,855 hot rows, 11 data_parallel"``: tables per sharding type, most
    first, and the hot rows the plan's hybrid tables replicate (the plan's own, else the sharder's)."""
    counts = describe_plan(plan)
    hot = sum(int(ids.numel()) for ids in planned_hot_ids(plan, sharder_hot_ids or {}).values())
    return ", ".join(f"{n} {t}" + (f" with {hot:,} hot rows" if t == FREQUENCY_HYBRID else "")
                     for t, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _sig3(x: float) -> str:
    """``x`` to three significant figures, trailing zeros kept (14.0, 1.30, 0.618, 123)."""
    if not x or not math.isfinite(x):
        return f"{x:g}"
    x = float(f"{x:.3g}")  # rounded first: 9.999 is 10.0, not 10.00
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def _ms(c: PlanCandidate) -> str:
    return _sig3(c.cost["cost_ms"])


def _mb(c: PlanCandidate) -> str:
    return _sig3(c.cost["busiest_bytes"] / 1e6)


def _estimate(c: PlanCandidate, short: bool = False) -> str:
    if short:
        return f"est. {_ms(c)} ms, {_mb(c)} MB"
    return f"est. {_ms(c)} ms per step, {_mb(c)} MB on the busiest rank"


def _verdict(c: PlanCandidate, chosen: PlanCandidate, left_out: Dict[str, str]) -> str:
    """Why candidate ``c`` was not chosen over ``chosen`` (``choose_plan``'s rules, in words)."""
    if c.name in left_out:
        return f"left out ({left_out[c.name]})"
    if c.cost["cost_ms"] > chosen.cost["cost_ms"]:
        return "costs more"
    if _is_stock(chosen):  # cheaper or as cheap, yet TorchRec's plan kept: it did not save min_saving
        return "saves too little over it (min_saving)"
    return "ties on cost, sends more bytes"


def plan_summary(result: PlanResult) -> Tuple[str, Dict[str, Any]]:
    """One line saying which plan this run trains and why, and the same as JSON fields.

    Hybrid planner: the candidate it returned (``planner.chosen``), set against TorchRec's plan
    priced by the same model (est. step cost and busiest-rank bytes per step), or, where TorchRec's
    plan won, what each hybrid candidate lacked; stock and manual planners compare nothing and say
    so. The fields: ``plan_summary`` (the line), ``plan_candidates`` (per candidate its name, types,
    estimates, whether chosen and why not) and ``planned_bandwidth`` (bytes/ms per rank, TorchRec's
    unit: the all-to-all bandwidth of the topology the planner held, read back from it)."""
    planner, plan = result.planner, result.plan
    fields: Dict[str, Any] = {"plan_candidates": [], "planned_bandwidth": None}
    if planner is not None:
        topo = _compat.planner_topology(planner)
        fields["planned_bandwidth"] = topo.comms_bandwidths.get_bw(topo.local_world_size, topo.world_size,
                                                                   CollectiveType.ALL_TO_ALL)
    chosen: Optional[PlanCandidate] = getattr(planner, "chosen", None)
    if result.name == "stock":
        line = f"TorchRec's own ({plan_types_text(plan)}): --planner stock, TorchRec's EmbeddingShardingPlanner " \
               "(nothing compared)"
    elif result.name == "manual":
        line = f"{plan_types_text(plan, getattr(result.sharder, 'hot_ids', None))}: --planner manual, every " \
               "table frequency_hybrid with " \
               "sharding.manual_hot_set's hot rows (not priced, nothing compared)"
    elif chosen is None:  # another rank than the one that planned (collective_plan plans on rank 0)
        line = f"{plan_types_text(plan)}: the hybrid planner's (compared on rank 0)"
    else:
        left_out = dict(planner.left_out)
        stock = next((c for c in planner.candidates if _is_stock(c)), None)
        others = [c for c in planner.candidates if c is not chosen and c is not stock]
        compared = {c.name for c in planner.candidates}
        unplanned = {n: w for n, w in left_out.items() if n not in compared}  # found no plan at all
        if stock is None:
            why = next((w for n, w in left_out.items() if n.startswith("stock")),
                       "the constraints allow a table no stock type")
            line = f"{plan_types_text(chosen.plan)}, {CANDIDATE_LABELS.get(chosen.name, chosen.name)}: no TorchRec " \
                   f"plan to compare with ({why}); {_estimate(chosen)}"
        elif chosen is stock:
            rest = "; ".join([f"{CANDIDATE_LABELS.get(c.name, c.name)} ({plan_types_text(c.plan)}) "
                              f"{_verdict(c, stock, left_out)}, {_estimate(c, short=True)}" for c in others]
                             + [f"{CANDIDATE_LABELS.get(n, n)}: {w}" for n, w in unplanned.items()])
            line = f"TorchRec's own ({plan_types_text(stock.plan)}): {_estimate(stock)}; the hybrid candidates " \
                   f"do not pay here: {rest or 'none was compared'}"
        else:
            why = "cheaper" if chosen.cost["cost_ms"] <= stock.cost["cost_ms"] else \
                "costs within the tie band, sends fewer bytes"
            line = f"{plan_types_text(chosen.plan)}, {CANDIDATE_LABELS.get(chosen.name, chosen.name)}, chosen over " \
                   f"TorchRec's plan ({plan_types_text(stock.plan)}): est. {_ms(chosen)} vs {_ms(stock)} ms per " \
                   f"step, {_mb(chosen)} vs {_mb(stock)} MB on the busiest rank ({why})"
        for c in planner.candidates:
            fields["plan_candidates"].append({
                "name": c.name, "types": describe_plan(c.plan), "cost_ms": c.cost["cost_ms"],
                "busiest_bytes": c.cost["busiest_bytes"], "chosen": c is chosen,
                "why_not": None if c is chosen else _verdict(c, chosen, left_out)})
        fields["plan_candidates"] += [{"name": n, "types": None, "cost_ms": None, "busiest_bytes": None,
                                       "chosen": False, "why_not": w} for n, w in unplanned.items()]
    if fields["planned_bandwidth"] is not None:
        how = ("measured" if result.measurement is not None else
               "the topology's own" if result.network_setting == "topology" else "sharding.network")
        line += f" [network {how}: {fields['planned_bandwidth'] / 1e3:,.0f} MB/s per rank]"
    fields["plan_summary"] = line
    return line, fields


def describe_plan(plan: ShardingPlan) -> Dict[str, int]:
    """How many tables each sharding type got."""
    out: Dict[str, int] = {}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():  # type: ignore[union-attr]
            out[ps.sharding_type] = out.get(ps.sharding_type, 0) + 1
    return out


def dense_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Parameters not updated by a fused (in-backward) optimizer, as TorchRec's DLRM example does."""
    return {n: p for n, p in in_backward_optimizer_filter(model.named_parameters()) if p.requires_grad}


def mlp_numel(model: torch.nn.Module) -> int:
    """Elements of the MLP parameters (DDP all-reduces their gradients each step).

    Data-parallel embedding tables are also DDP parameters, but their all-reduce is
    embedding traffic, so they are not counted here.
    """
    return sum(p.numel() for n, p in dense_parameters(model).items() if "embedding_bag_collection" not in n)
