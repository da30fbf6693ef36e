"""Model side of the DLRM example: DLRM, its sharding plan, DMP and the optimizers.

- ``build_model``: ``torchrec.models.dlrm.DLRM`` (embedding tables on the meta device, so
  DMP allocates only each rank's shards) wrapped in ``DLRMTrain`` (adds the BCE loss).
- ``build_plan``: one of three planners (``sharding.planner``):
  ``hybrid``  ``torchrec_hybrid.planner.HybridEmbeddingShardingPlanner`` fed with the
              frequency statistics: it picks each table's sharding type and the hot set of
              each hybrid table (options under ``sharding.hybrid``);
  ``manual``  every table ``frequency_hybrid`` (hot rows replicated, cold rows row-wise);
  ``stock``   TorchRec's ``EmbeddingShardingPlanner`` with the stock sharder (comparison).
- ``build_optimizer``: embeddings use FBGEMM's fused optimizer (applied in backward); the
  dense parameters get a torch optimizer; both are combined as in TorchRec's DLRM example.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder, frequency_hybrid
from torchrec_hybrid.stats import FrequencyStats, HotSetRule

logger = logging.getLogger(__name__)

EBC_PATH = "model.sparse_arch.embedding_bag_collection"  # DLRMTrain -> DLRM -> SparseArch -> EBC

EMB_OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}
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
    h = dict(cfg.sharding.hot_set)
    opt = cfg.optim.embedding.optimizer
    if "memory_budget_bytes" in h:
        h.setdefault("optimizer", opt)
    return HotSetRule(**h)


def _hybrid_planner_class():
    try:
        from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner
    except ImportError:  # a checkout without the planner
        return None
    return HybridEmbeddingShardingPlanner


def _topology(world_size: int, device: torch.device) -> Topology:
    # ranks per host, as torchrun sets it; a multi-node job is planned as several hosts
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cpu":
        try:  # gloo: one bandwidth for every collective (torchrec's defaults describe NVLink)
            from torchrec_hybrid.planner import gloo_topology
        except ImportError:
            pass
        else:
            return gloo_topology(world_size, local_world_size=local)
    return Topology(world_size=world_size, local_world_size=local, compute_device=device.type)


def build_plan(cfg, model: torch.nn.Module, stats: Optional[FrequencyStats], hot_ids: Dict[str, torch.Tensor],
               world_size: int, device: torch.device, pg: dist.ProcessGroup
               ) -> Tuple[ShardingPlan, ModuleSharder, str]:
    """(plan, sharder, planner actually used).

    ``hybrid``: the planner picks each table's type and, for hybrid tables, its hot set
    (carried in the plan) from the statistics. ``manual``: every table ``frequency_hybrid``
    with ``hot_ids`` (from ``sharding.hot_set``). ``stock``: TorchRec's planner and sharder.
    """
    kind = cfg.sharding.planner
    fp = fused_params(cfg)
    topology = _topology(world_size, device)
    if kind == "stock":
        sharder = EmbeddingBagCollectionSharder(fused_params=fp)
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=cfg.data.batch_size)
        return planner.collective_plan(model, [sharder], pg), sharder, "stock"
    if kind not in ("hybrid", "manual"):
        raise ValueError(f"sharding.planner must be hybrid, stock or manual, got {kind!r}")
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids=hot_ids, fused_params=fp)
    if kind == "hybrid":
        planner_cls = _hybrid_planner_class()
        if planner_cls is not None:
            opts = {k: v for k, v in dict(cfg.sharding.hybrid).items() if v is not None}
            planner = planner_cls(topology=topology, batch_size=cfg.data.batch_size, frequency_stats=stats, **opts)
            return planner.collective_plan(model, [sharder], pg), sharder, "hybrid"
        logger.warning("torchrec_hybrid.planner is not available; using the manual plan")
    ebc = model.model.sparse_arch.embedding_bag_collection
    gens = {c.name: frequency_hybrid() for c in ebc.embedding_bag_configs()}
    plan = construct_module_sharding_plan(ebc, gens, sharder=sharder, local_size=world_size,
                                          world_size=world_size, device_type=device.type)
    return ShardingPlan({EBC_PATH: plan}), sharder, "manual"


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


def build_optimizer(cfg, model: DistributedModelParallel) -> CombinedOptimizer:
    """The fused embedding optimizer plus a torch optimizer over every other parameter."""
    o = cfg.optim.dense
    if o.optimizer not in DENSE_OPTIMIZERS:
        raise ValueError(f"optim.dense.optimizer must be one of {list(DENSE_OPTIMIZERS)}")
    dense = dense_parameters(model)
    kwargs = {"lr": float(o.lr)}
    if o.optimizer == "adagrad":
        kwargs["eps"] = float(o.get("eps", 1e-8))
    opt_cls = DENSE_OPTIMIZERS[o.optimizer]
    dense_opt = KeyedOptimizerWrapper(dense, lambda params: opt_cls(params, **kwargs))
    return CombinedOptimizer([model.fused_optimizer, dense_opt])


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
