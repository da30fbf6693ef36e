"""Quantized comms as a user meets them: bytes per rank with and without a QCommsConfig.

The product benchmark's set-up (``benchmarks/product.py``: 26 Criteo-Kaggle tables capped at
``--rows-cap`` rows, dim 64, Zipf(1.1), EXACT_ROWWISE_ADAGRAD, statistics from batches of
their own) on W gloo ranks. Four models train on the same batches, in balanced orders
(``stepping.step_models``): the hybrid planner's plan (bytes-priced, as on CUDA) and TorchRec's planner's plan, each
with fp32 comms and with ``QCommsConfig(forward_precision=FP16, backward_precision=BF16)``
(the registry given to both sharders, and to the planners, which price the codec). Per model:
bytes each rank sends per step (``wchar`` of ``/proc/self/io``), mean and busiest rank.

    python -m benchmarks.qcomms [--world 4] [--workloads onehot multihot] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Dict, List

import torch

from benchmarks import malloc
from benchmarks.spawner import spawn_ranks
from benchmarks.stepping import step_models
from benchmarks.workloads import WORKLOADS, fused_params, workload_data

logger = logging.getLogger(__name__)

MODELS = ("hybrid_fp32", "hybrid_fp16_bf16", "stock_fp32", "stock_fp16_bf16")


def _registry():
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    # device="cuda": TorchRec's registry for a CPU device silently turns BF16 into FP16 ("not on GLOO")
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16),
                                     device=torch.device("cuda"))


def _models(tables, stats, spec: Dict[str, Any], world: int, pg) -> Dict[str, Any]:
    """A DistributedModelParallel per model of :data:`MODELS`, each planned by its own planner."""
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, HybridEmbeddingShardingPlanner

    fused = fused_params()
    topo = Topology(world_size=world, compute_device="cpu")
    models = {}
    for name in MODELS:
        registry = _registry() if name.endswith("fp16_bf16") else None
        ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        if name.startswith("hybrid"):
            sharder: Any = HybridEmbeddingBagCollectionSharder(fused_params=dict(fused), qcomm_codecs_registry=registry)
            planner: Any = HybridEmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"],
                                                          frequency_stats=stats, compute_costs=None)
        else:
            sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused), qcomm_codecs_registry=registry)
            planner = EmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"])
        plan = planner.collective_plan(ebc, [sharder], pg)
        models[name] = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return models


def _rank_main(rank: int, world: int, emit, spec: Dict[str, Any], rows_cap: int, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    tables, stats, batches = workload_data(spec, world, rank, rows_cap, 8, warmup + steps)
    models = _models(tables, stats, spec, world, dist.GroupMember.WORLD)
    logging.disable(logging.CRITICAL)
    sent: Dict[str, List[int]] = {m: [] for m in MODELS}
    times: Dict[str, List[float]] = {m: [] for m in MODELS}
    for i, kjt in enumerate(batches):
        step_models(models, MODELS, kjt, i - warmup, i >= warmup, sent, times)  # rows counted from the first timed step
    emit({"allocator": malloc.current(), **{m: sum(v) / len(v) for m, v in sent.items()}})


def run_one(name: str, world: int, rows_cap: int, warmup: int, steps: int) -> Dict[str, Any]:
    per_rank = [items[0] for items in spawn_ranks(_rank_main, world, timeout=3000, spec=WORKLOADS[name],
                                                  rows_cap=rows_cap, warmup=warmup, steps=steps)]
    res: Dict[str, Any] = {"workload": name, "world": world, "batch": WORKLOADS[name]["batch"],
                           "allocator": per_rank[0]["allocator"]}
    for m in MODELS:
        sent = [r[m] for r in per_rank]
        res[m] = {"sent_per_rank": sent, "mean_bytes": sum(sent) / world, "busiest_bytes": max(sent)}
    for plan in ("hybrid", "stock"):
        fp32, q = res[f"{plan}_fp32"], res[f"{plan}_fp16_bf16"]
        res[f"{plan}_drop"] = {k: 1 - q[k] / fp32[k] for k in ("mean_bytes", "busiest_bytes")}
    return res


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    lines = ["| workload | W | plan | busiest-rank MB: fp32 / fp16-bf16 | drop | mean drop |",
             "|---|---:|---|---:|---:|---:|"]
    for r in results:
        for plan, label in (("hybrid", "hybrid planner"), ("stock", "stock planner")):
            fp32, q, d = r[f"{plan}_fp32"], r[f"{plan}_fp16_bf16"], r[f"{plan}_drop"]
            lines.append(f"| {r['workload']} | {r['world']} | {label} | {fp32['busiest_bytes'] / 1e6:.2f} / "
                         f"{q['busiest_bytes'] / 1e6:.2f} | {d['busiest_bytes'] * 100:.0f}% | "
                         f"{d['mean_bytes'] * 100:.0f}% |")
    return lines


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[4])
    ap.add_argument("--workloads", nargs="+", default=["onehot", "multihot"], choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="out/qcomms")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    results = []
    for w in a.world:
        for name in a.workloads:
            results.append(run_one(name, w, a.rows_cap, a.warmup, a.steps))
            r = results[-1]
            logger.info("%s W=%d: hybrid busiest bytes drop %.0f%%, stock %.0f%%", name, w,
                        100 * r["hybrid_drop"]["busiest_bytes"], 100 * r["stock_drop"]["busiest_bytes"])
            with open(a.out + ".json", "w") as f:
                json.dump({"args": vars(a), "results": results}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(markdown(results)) + "\n")
    return results


if __name__ == "__main__":
    main()
