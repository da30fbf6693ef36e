"""TorchRec's own plan under our sharder: what the product costs where the planner keeps stock types.

On these CPU machines the CPU-priced hybrid planner returns TorchRec's planner's plan for DLRMv2
multi-hot bags and uniform ids (``benchmarks/product.py``) and at every sweep configuration
(``python -m benchmarks``), so there the hybrid planner's step against the stock planner's is our
sharder's cost on an identical plan: its per-step check of every id on every rank
(``HybridEmbeddingBagCollectionSharder(validate_ids=True)``, the default), less FBGEMM's own
per-call bounds check, which the module's TBEs skip while that check is on. The
sweep's few steps resolve that comparison coarsely, and the "fastest stock plan" it is held
against is the faster of two runs of that same plan (``table_wise`` and ``planner``). This
benchmark measures it on its own, with many steps: the stock planner's plan for the product
benchmark's tables (26 Criteo-Kaggle tables capped at ``--rows-cap``, dim 64, row-wise Adagrad)
under TorchRec's ``EmbeddingBagCollectionSharder``, under ours, and under ours with
``validate_ids=False``; one gloo process group, the same batches, one step of each per round in a
balanced order (a Williams design, ``measure.balanced_orders``) behind a barrier. Per model: the
median over steps of the slowest rank's step; over steps, the quartiles of its paired ratio to
the stock step of the same round, and the median of that ratio with a distribution-free 95%
confidence interval (order statistics); the same against our sharder without the id check (the
check's net cost: that run keeps FBGEMM's bounds check); the median over steps of the ranks'
summed process CPU; and the bytes each rank sends (``/proc/self/io``, integer totals over the timed steps).

    python -m benchmarks.same_plan                          # W=4, onehot + multihot, ~2 min here
    python -m benchmarks.same_plan --out benchmarks/results # the committed run
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any, Dict, List

import torch

from benchmarks.measure import median_ci, slowest_rank
from benchmarks.stepping import interleaved_steps
from benchmarks.workloads import WORKLOADS, fused_params, plan_types, workload_data
from benchmarks.report import write_results
from benchmarks import malloc
from benchmarks.spawner import spawn_ranks

logger = logging.getLogger(__name__)

# model name -> the sharder it is built with (the plan is the stock planner's for all three)
MODELS = {"stock sharder": "stock", "our sharder": "ours", "our sharder, validate_ids=False": "ours_unchecked"}


def _quartiles(xs: List[float]) -> List[float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return [q[0], statistics.median(xs), q[2]]


def _ratios(a: List[float], b: List[float]) -> List[float]:
    return [x / y for x, y in zip(a, b)]


def _rank_main(rank: int, world: int, emit, workload: str, rows_cap: int, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from benchmarks.measure import balanced_orders
    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    spec = WORKLOADS[workload]
    tables, _, batches = workload_data(spec, world, rank, rows_cap, 8, warmup + steps)
    fused = fused_params()
    sharders = {"stock": EmbeddingBagCollectionSharder(fused_params=dict(fused)),
                "ours": HybridEmbeddingBagCollectionSharder(fused_params=dict(fused)),
                "ours_unchecked": HybridEmbeddingBagCollectionSharder(fused_params=dict(fused), validate_ids=False)}

    def ebc():
        return torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                    batch_size=spec["batch"]).collective_plan(ebc(), [sharders["stock"]],
                                                                              dist.GroupMember.WORLD)
    models = {n: DistributedModelParallel(ebc(), device=torch.device("cpu"), plan=plan, sharders=[sharders[s]])
              for n, s in MODELS.items()}
    names = list(MODELS)
    orders = balanced_orders(len(names))
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    measured = interleaved_steps(models, batches, warmup,  # orders balanced over the timed steps
                                 lambda i: [names[j] for j in orders[(i - warmup) % len(orders)]])
    emit(dict(measured, types=plan_types(plan), allocator=malloc.current()))


def run(workload: str, world: int, rows_cap: int, warmup: int, steps: int) -> Dict[str, Any]:
    outs = [items[0] for items in spawn_ranks(_rank_main, world, timeout=3000, workload=workload,
                                                     rows_cap=rows_cap, warmup=warmup, steps=steps)]
    slowest = {n: slowest_rank([o["wall"][n] for o in outs]) for n in MODELS}
    cpu_sum = {n: [sum(o["cpu"][n][i] for o in outs) for i in range(steps)] for n in MODELS}
    stock, unchecked = slowest["stock sharder"], slowest["our sharder, validate_ids=False"]
    models = {}
    for n in MODELS:
        total = [int(sum(o["sent"][n])) for o in outs]  # bytes per rank over the timed steps
        models[n] = {"median_step_ms": statistics.median(slowest[n]) * 1e3,
                     "step_vs_stock": statistics.median(slowest[n]) / statistics.median(stock),
                     "paired_ratio_quartiles": _quartiles(_ratios(slowest[n], stock)),
                     "paired_ratio_median_ci": median_ci(_ratios(slowest[n], stock)),
                     "paired_vs_unchecked_median_ci": median_ci(_ratios(slowest[n], unchecked)),
                     "cpu_ms_per_step_all_ranks": statistics.median(cpu_sum[n]) * 1e3,
                     "sent_bytes_total_per_rank": total,
                     "mean_bytes": sum(total) / world / steps, "busiest_bytes": max(total) / steps}
    s = models["stock sharder"]
    for m in models.values():
        m["cpu_vs_stock"] = m["cpu_ms_per_step_all_ranks"] / s["cpu_ms_per_step_all_ranks"]
    return {"workload": workload, "world": world, "batch": WORKLOADS[workload]["batch"], "rows_cap": rows_cap,
            "warmup": warmup, "steps": steps, "allocator": outs[0]["allocator"], "plan_types": outs[0]["types"],
            "models": models}


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    lines = ["| workload | W | sharder (TorchRec's planner's plan) | median step, ms | vs stock "
             "| per-step ratio to stock: quartiles | its median [95% CI] | process CPU / step, ms (all ranks) "
             "| vs stock | MB / rank (busiest) |",
             "|---|---:|---|---:|---:|---|---|---:|---:|---:|"]
    for r in results:
        for n, m in r["models"].items():
            q, c = m["paired_ratio_quartiles"], m["paired_ratio_median_ci"]
            lines.append(f"| {r['workload']} | {r['world']} | {n} | {m['median_step_ms']:.1f} | "
                         f"{m['step_vs_stock']:.3f}x | {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} | "
                         f"{c[1]:.3f} [{c[0]:.3f}, {c[2]:.3f}] | {m['cpu_ms_per_step_all_ranks']:.1f} | "
                         f"{m['cpu_vs_stock']:.3f}x | {m['busiest_bytes'] / 1e6:.2f} |")
    return lines


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["onehot", "multihot"], choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=180, help="timed steps per sharder (a multiple of 6 balances "
                    "the three sharders' orders: each takes each position, and follows each other, equally often)")
    ap.add_argument("--out", default="out/same_plan")
    a = ap.parse_args(argv)
    if a.world < 2 or a.steps < 2 or a.warmup < 0:
        ap.error(f"--world must be >= 2, --steps >= 2 and --warmup >= 0 (got {a.world}, {a.steps}, {a.warmup})")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    results = []
    for w in a.workloads:
        logger.info("same plan, three sharders: %s, W=%d, %d steps", w, a.world, a.steps)
        results.append(run(w, a.world, a.rows_cap, a.warmup, a.steps))
    args = {k: v for k, v in vars(a).items() if k != "out"}
    doc = {"args": args, "allocator": malloc.described(results), "results": results}
    print(write_results(a.out, "same_plan", doc, markdown(results) + ["", f"Allocator: {doc['allocator']}."]))
    return results


if __name__ == "__main__":
    main()
