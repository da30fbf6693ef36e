"""Builds one sharded model per sharding type, and its training step.

Stock types use TorchRec's own ``EmbeddingBagCollectionSharder`` (so the baselines contain
no code of this project); ``frequency_hybrid`` uses ``HybridEmbeddingBagCollectionSharder``.
Manual plans put table i on rank i % W (table_wise) or on ranks i % W and (i + 1) % W
(column_wise, two shards), frequency_hybrid on even row blocks (table-wise cold on rank i % W
for a table with fewer rows than ranks, where even blocks would leave a rank empty);
row_wise is planned by hand because TorchRec's planner only offers it on CUDA. Every non-DP
manual plan uses the fused kernel (else weights never update). Dense parameters (DLRM MLPs,
data_parallel tables) get plain SGD. The plans a user gets: ``planner`` (TorchRec's
``EmbeddingShardingPlanner``, stock types) and ``hybrid_planner`` / ``hybrid_planner_bytes``
(``HybridEmbeddingShardingPlanner`` from the workload's statistics, its hot sets its own: compute
priced by the default calibration for the device, or bytes and collectives only,
``compute_costs=None``, as for a network-bound cluster).
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import (
    column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, HybridEmbeddingShardingPlanner, frequency_hybrid
from torchrec_hybrid.stats import FrequencyStats

from benchmarks.config import PLANNER_COMPUTE_COSTS, Workload
from benchmarks.data import DENSE_FEATURES, Batch

LR = 0.01
FUSED = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
EBC_PATH = {"ebc": "", "dlrm": "sparse_arch.embedding_bag_collection"}


_LOSS_WEIGHTS: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}


def training_loss(pooled: torch.Tensor) -> torch.Tensor:
    """The loss every EBC benchmark trains on: a fixed random linear function of the pooled embeddings.

    Its gradient is one dense tensor of the output's shape (the same random values every
    step, seed 0), what a real model's backward hands the EBC, and the loss adds no other
    work (a dot product forward, one multiply backward). The mean square used before also
    computed, and page-faulted in, three more tensors of the output's size per step: work
    common to every plan, a sizeable share of a step, that pulled every ratio towards 1.
    A plain ``sum()`` has a stride-0 gradient (one value, expanded), which the backward's
    gathers read from cache: it made a hybrid step cheaper than a real gradient does, and a
    stock step (whose output all-to-all copies the gradient once) far less so.
    """
    key = (tuple(pooled.shape), pooled.dtype, pooled.device)
    weights = _LOSS_WEIGHTS.get(key)
    if weights is None:
        gen = torch.Generator().manual_seed(0)
        weights = torch.randn(pooled.numel(), generator=gen).div_(max(pooled.numel(), 1))
        weights = _LOSS_WEIGHTS[key] = weights.to(device=pooled.device, dtype=pooled.dtype)
    return torch.dot(pooled.reshape(-1), weights)


@dataclass
class Built:
    model: torch.nn.Module
    step: Callable[[Batch], None]
    table_types: Dict[str, list]  # [sharding type, number of shards] per table, as planned
    dense_numel: int              # parameters outside the EBC (all-reduced by DDP every step)
    planner_bytes: Optional[float] = None  # the hybrid planner's own estimate, mean bytes per rank per step


def _module(w: Workload, tables: List[torchrec.EmbeddingBagConfig], device: torch.device) -> torch.nn.Module:
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if w.model == "ebc":
        return ebc
    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_FEATURES,
                dense_arch_layer_sizes=[64, w.dim], over_arch_layer_sizes=[64, 1], dense_device=device)


def _manual(kind: str, i: int, world: int, rows: int):
    if kind == "frequency_hybrid" and rows < world:  # even blocks would leave a rank empty: table-wise cold
        return frequency_hybrid(cold="table_wise", rank=i % world)
    return {
        "table_wise": lambda: table_wise(rank=i % world, compute_kernel="fused"),
        "column_wise": lambda: column_wise(ranks=sorted({i % world, (i + 1) % world}), compute_kernel="fused"),
        "row_wise": lambda: row_wise(compute_kernel="fused"),
        "data_parallel": lambda: data_parallel(),
        "frequency_hybrid": lambda: frequency_hybrid(),
    }[kind]()


def build(kind: str, w: Workload, tables, hot_ids, device: torch.device,
          stats: Optional[FrequencyStats] = None) -> Built:
    """DMP of workload `w`'s model with every table sharded as `kind` ('planner': stock planner;
    'hybrid_planner' / 'hybrid_planner_bytes': the hybrid planner's plan from ``stats``)."""
    world = dist.get_world_size()
    estimate = None
    if kind == "frequency_hybrid" or kind in PLANNER_COMPUTE_COSTS:  # the planner's plans carry their hot ids
        sharder = HybridEmbeddingBagCollectionSharder(hot_ids=hot_ids if kind == "frequency_hybrid" else None,
                                                      fused_params=dict(FUSED))
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    module = _module(w, tables, device)
    path = EBC_PATH[w.model]
    dense_numel = sum(p.numel() for n, p in module.named_parameters() if "embedding_bag" not in n)
    ebc = module if path == "" else module.get_submodule(path)
    if kind == "planner":
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device=device.type),
                                           batch_size=w.batch_per_rank)
        plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    elif kind in PLANNER_COMPUTE_COSTS:
        if stats is None:
            raise ValueError(f"benchmark model {kind!r} plans from frequency statistics: pass stats")
        hybrid = HybridEmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device=device.type), batch_size=w.batch_per_rank,
            frequency_stats=stats, compute_costs=PLANNER_COMPUTE_COSTS[kind])
        plan = hybrid.collective_plan(module, [sharder], dist.GroupMember.WORLD)
        rank_bytes = hybrid.estimated_rank_bytes()
        estimate = sum(rank_bytes) / len(rank_bytes) if rank_bytes else None
    else:
        mplan = construct_module_sharding_plan(
            ebc, {t.name: _manual(kind, i, world, t.num_embeddings) for i, t in enumerate(tables)}, sharder=sharder,
            local_size=world, world_size=world, device_type=device.type)
        plan = ShardingPlan({path: mplan})
    model = DistributedModelParallel(module, device=device, plan=plan, sharders=[sharder])
    types = {name: [ps.sharding_type, len(ps.ranks or [])] for name, ps in plan.plan[path].items()}
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    opt = torch.optim.SGD(dense, lr=LR) if dense else None

    if w.model == "ebc":
        def loss_fn(b: Batch) -> torch.Tensor:
            return training_loss(model(b.sparse.to(device)).wait().values())
    else:
        bce = torch.nn.BCEWithLogitsLoss()

        def loss_fn(b: Batch) -> torch.Tensor:
            logits = model(b.dense.to(device), b.sparse.to(device)).squeeze(-1)
            return bce(logits, b.labels.to(device))

    def step(b: Batch) -> None:
        loss_fn(b).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return Built(model, step, types, dense_numel, estimate)
