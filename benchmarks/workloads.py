"""The product benchmark's workloads and plans, shared by every benchmark at its sizes.

26 Criteo-Kaggle tables capped at ``rows_cap`` rows, dim 64, row-wise Adagrad (:func:`fused_params`); per
workload a batch size and an id distribution (:data:`WORKLOADS`); frequency statistics counted on batches of
their own, then the batches trained on (:func:`workload_data`); the plans of the hybrid planner (both pricings,
:data:`HYBRID_MODELS`) and of TorchRec's planner for one topology, each in a ``DistributedModelParallel``
(:func:`plan_models`); a plan's tables per sharding type (:func:`plan_types`, :func:`types_text`).
Used by ``benchmarks.product``, ``candidates``, ``calibrate``, ``qcomms`` and ``drift``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from benchmarks.data import rank_slice


WORKLOADS = {
    "onehot": dict(multi_hot=False, alpha=1.1, sorted_ids=False, batch=1024),
    "multihot": dict(multi_hot=True, alpha=1.1, sorted_ids=False, batch=512),
    "sorted-onehot": dict(multi_hot=False, alpha=1.1, sorted_ids=True, batch=1024),
    "sorted-multihot": dict(multi_hot=True, alpha=1.1, sorted_ids=True, batch=512),
    "uniform": dict(multi_hot=False, alpha=0.0, sorted_ids=False, batch=1024),
}
# the plans the product trains: the hybrid planner's two pricings and TorchRec's planner's plan
MODELS = ("hybrid_planner", "hybrid_planner_bytes", "stock_planner")
# the hybrid planner as a user on this machine gets it (compute priced by the CPU calibration,
# planner/compute_costs.py) and as it plans for a network-bound cluster (bytes and collectives)
HYBRID_MODELS = {"hybrid_planner": "default", "hybrid_planner_bytes": None}


def fused_params() -> Dict[str, Any]:
    """The fused optimizer every benchmark of the product's sizes trains with: row-wise Adagrad, lr 0.01
    (a fresh dict: sharders keep theirs)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}


def workload_data(spec: Dict[str, Any], world: int, rank: int, rows_cap: int, stats_batches: int, steps: int):
    """The tables, the statistics (``stats_batches`` global batches) and ``steps`` other batches of workload ``spec``
    on ``rank`` (its slice of each global batch: every rank draws the same ones, seed 0)."""
    from torchrec_hybrid.stats import FrequencyStats, criteo_table_sizes, criteo_tables
    from torchrec_hybrid.stats.synthetic import SyntheticCriteo

    sizes = criteo_table_sizes(max_rows=rows_cap)
    tables = criteo_tables(sizes, embedding_dim=64)
    b = spec["batch"]
    gen = SyntheticCriteo(sizes, batch_size=b * world, num_batches=stats_batches + steps, alpha=spec["alpha"],
                          multi_hot=spec["multi_hot"], seed=0, sorted_ids=spec["sorted_ids"])
    stats, batches = FrequencyStats(tables), []
    for i, kjt in enumerate(gen):  # statistics from other batches than the measured ones
        if i < stats_batches:
            stats.update(kjt)
        else:
            batches.append(rank_slice(kjt, gen.hotness, rank, b))
    return tables, stats, batches


def plan_models(tables, stats, spec: Dict[str, Any], world: int, pg, prices: Optional[Any] = None,
                 tie_ms: Any = "auto", network: Optional[Any] = None):
    """Plan the EBC with the hybrid planner (both pricings) and TorchRec's planner for the same topology; the
    hybrid planners, the plans and a DistributedModelParallel per plan, by model name. ``prices``: the
    CPU-priced planner's ``ComputeCosts`` instead of the machine's default (None: the default); ``tie_ms``: its
    tie band (the planner's argument; the network-priced planner has none); ``network``: a measured
    ``NetworkMeasurement`` every planner plans for (TorchRec's: ``network.apply_to(topology)``; the hybrid
    planner's: ``network=``), None: the default topology's bandwidths."""
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, HybridEmbeddingShardingPlanner

    fused = fused_params()
    topo = Topology(world_size=world, compute_device="cpu")

    def ebc():
        return torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

    hyb_sharder = HybridEmbeddingBagCollectionSharder(fused_params=dict(fused))
    priced = {m: prices if prices is not None and costs == "default" else costs for m, costs in HYBRID_MODELS.items()}
    planners = {m: HybridEmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"], frequency_stats=stats,
                                                  compute_costs=costs,
                                                  tie_ms=tie_ms if HYBRID_MODELS[m] == "default" else 0.0,
                                                  network=network)
                for m, costs in priced.items()}
    plans = {m: p.collective_plan(ebc(), [hyb_sharder], pg) for m, p in planners.items()}
    stock_sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused))
    stock_topo = topo if network is None else network.apply_to(topo)
    plans["stock_planner"] = EmbeddingShardingPlanner(topology=stock_topo, batch_size=spec["batch"]).collective_plan(
        ebc(), [stock_sharder], pg)
    models = {name: DistributedModelParallel(ebc(), device=torch.device("cpu"), plan=plans[name],
                                             sharders=[hyb_sharder if name in HYBRID_MODELS else stock_sharder])
              for name in MODELS}
    return planners, plans, models


def plan_types(plan) -> Dict[str, int]:
    """How many tables of ``plan`` per sharding type (frequency_hybrid ones per cold layout)."""
    counts: Dict[str, int] = {}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            key = ps.sharding_type + ("/" + ps.cold_layout + "-cold" if hasattr(ps, "cold_layout") else "")
            counts[key] = counts.get(key, 0) + 1
    return counts


def types_text(types: Dict[str, int]) -> str:
    """A plan's :func:`plan_types` as the reports print it: ``"21 frequency_hybrid/row_wise-cold, 5 ..."``."""
    return ", ".join(f"{n} {t}" for t, n in sorted(types.items()))
