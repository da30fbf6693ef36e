"""Every plan the hybrid planner weighed, trained: does its cost model rank them as the steps do?

``HybridEmbeddingShardingPlanner`` prices three candidate plans - TorchRec's planner's plan, its
own mixed plan (stock and frequency_hybrid options through TorchRec's partitioner) and every
eligible table frequency_hybrid - and returns the cheapest (``planner.py``: never more
busiest-rank bytes than the stock plan). The product benchmark trains only the plans it returns.
This one trains every candidate of both pricings - the CPU-priced planner's (this machine's
default) and the network-priced one's (bytes and collectives) - on the same tables, statistics
and batches as ``benchmarks/product.py``, in one gloo process group, step by step in a Williams
order, and reports per candidate the model's cost against the measured median step (the slowest
rank's), the paired per-step ratio to the stock plan, process CPU and bytes per rank. Identical
candidates (TorchRec's plan is one in both) train once.

    python -m benchmarks.candidates                                      # W=4, onehot + multihot + uniform
    python -m benchmarks.candidates --out benchmarks/results             # the committed run
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any, Dict, List, Tuple

import torch

from benchmarks import malloc
from benchmarks.measure import balanced_orders, ci_text, median_ci, slowest_rank
from benchmarks.product import (HYBRID_MODELS, WORKLOADS, fused_params, interleaved_steps, plan_models, plan_types,
                                types_text, workload_data)
from benchmarks.report import write_results

logger = logging.getLogger(__name__)

STOCK = "stock: TorchRec's EmbeddingShardingPlanner"  # the name the planner gives TorchRec's plan
MIXED = "hybrid planner: stock + hybrid options"  # ... and its partitioner's plan over both kinds of options
LEGEND = ("Per workload, every candidate plan of the CPU-priced planner (`hybrid_planner`, the default here) and of "
          "the network-priced one (`hybrid_planner_bytes`), each under our sharder, trained in one process group; "
          "model cost: the planner's estimate (ms; its units differ between the two pricings; - where that planner "
          "did not weigh the plan), * on the plan it returned; step: the slowest rank's, median over the "
          "interleaved steps, and the per-step ratio to TorchRec's plan (under our sharder too) with its 95% "
          "interval; CPU: process CPU per step, summed over the ranks.")


def plan_signature(plan: Any) -> Tuple:
    """What makes two plans train alike: per table its type, kernel, cold layout, shard placements, hot rows
    and pooling factor (the last two only for hybrid tables)."""
    out = []
    for path, module_plan in sorted(plan.plan.items()):
        for name, ps in sorted(module_plan.items()):
            shards = tuple((tuple(s.shard_offsets), tuple(s.shard_sizes), str(s.placement))
                           for s in (ps.sharding_spec.shards if ps.sharding_spec is not None else []))
            hot = getattr(ps, "hot_ids", None)
            out.append((path, name, ps.sharding_type, ps.compute_kernel, getattr(ps, "cold_layout", None),
                        tuple(ps.ranks or ()), shards, None if hot is None else tuple(hot.tolist()),
                        getattr(ps, "pooling_factor", None)))
    return tuple(out)


def _candidates(planners: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Rank 0's candidates of every pricing, identical plans merged: per plan, the pricings that weighed it
    (the names that pricing gave it, its model cost, whether that planner chose it), its types, the plan."""
    merged: Dict[Tuple, Dict[str, Any]] = {}
    for pricing, planner in planners.items():
        for c in planner.candidates:
            entry = merged.setdefault(plan_signature(c.plan), {"plan": c.plan, "types": plan_types(c.plan),
                                                                "names": [], "priced": {}})
            if c.name not in entry["names"]:
                entry["names"].append(c.name)
            mine = entry["priced"].setdefault(pricing, {"names": [], "cost_ms": c.cost["cost_ms"],
                                                        "busiest_bytes": c.cost["busiest_bytes"], "chosen": False})
            # one planner may weigh the same plan twice (its mixed plan = TorchRec's): one entry, either's mark
            mine["names"].append(c.name)
            mine["chosen"] = mine["chosen"] or c is planner.chosen
    return list(merged.values())


def _rank_main(rank: int, world: int, emit, workload: str, rows_cap: int, stats_batches: int, warmup: int,
               steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    spec = WORKLOADS[workload]
    tables, stats, batches = workload_data(spec, world, rank, rows_cap, stats_batches, warmup + steps)
    planners, returned = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD)[:2]  # (its models unused)
    # the planners compare their candidates on rank 0 (collective_plan sends the other ranks the winner only)
    found = [_candidates(planners) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    cands = found[0]
    assert cands is not None
    sharder = HybridEmbeddingBagCollectionSharder(fused_params=fused_params())
    names = [f"plan {i}" for i in range(len(cands))]
    models = {n: DistributedModelParallel(torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                                          device=torch.device("cpu"), plan=c["plan"], sharders=[sharder])
              for n, c in zip(names, cands)}
    orders = balanced_orders(len(names))
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    measured = interleaved_steps(models, batches, warmup,  # orders balanced over the timed steps
                                 lambda i: [names[j] for j in orders[(i - warmup) % len(orders)]])
    emit(dict(measured, names=names, candidates=[{k: c[k] for k in ("types", "names", "priced")} for c in cands],
              returned={m: plan_types(returned[m]) for m in HYBRID_MODELS}, allocator=malloc.current()))


def run_one(workload: str, world: int, rows_cap: int, stats_batches: int, warmup: int, steps: int) -> Dict[str, Any]:
    outs = [items[0] for items in malloc.spawn_ranks(_rank_main, world, timeout=3000, workload=workload,
                                                     rows_cap=rows_cap, stats_batches=stats_batches,
                                                     warmup=warmup, steps=steps)]
    r0 = outs[0]
    names = r0["names"]
    step = {n: slowest_rank([o["wall"][n] for o in outs]) for n in names}  # per batch, the slowest rank's
    cpu = {n: sum(statistics.median(o["cpu"][n]) for o in outs) for n in names}  # summed over the ranks
    stock = next(n for n, c in zip(names, r0["candidates"]) if STOCK in c["names"])
    plans = []
    for n, c in zip(names, r0["candidates"]):
        sent = [statistics.mean(o["sent"][n]) for o in outs]
        plans.append(dict(c, median_step_ms=statistics.median(step[n]) * 1e3,
                          paired_step_ci=median_ci([a / b for a, b in zip(step[n], step[stock])]),
                          cpu_ms_sum=cpu[n] * 1e3, cpu_vs_stock=cpu[n] / cpu[stock],
                          mean_bytes=sum(sent) / world, busiest_bytes=max(sent)))
    return {"workload": workload, "world": world, "batch": WORKLOADS[workload]["batch"], "steps": steps,
            "warmup": warmup, "rows_cap": rows_cap, "allocator": r0["allocator"], "returned": r0["returned"],
            "plans": plans}


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    pricings = list(HYBRID_MODELS)
    lines = [LEGEND, "",
             "| workload | W | candidate | its types | model cost: CPU-priced / network-priced | median step, ms "
             "| per-step ratio to stock [95% CI] | CPU, ms (vs stock) | MB / rank: mean / busiest |",
             "|---|---:|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        for p in r["plans"]:
            cost = " / ".join("-" if m not in p["priced"] else
                              f"{p['priced'][m]['cost_ms']:.2f}" + ("*" if p["priced"][m]["chosen"] else "")
                              for m in pricings)
            lines.append(f"| {r['workload']} | {r['world']} | {'; '.join(p['names'])} | {types_text(p['types'])} | "
                         f"{cost} | {p['median_step_ms']:.1f} | {ci_text(p['paired_step_ci'])} | "
                         f"{p['cpu_ms_sum']:.1f} ({p['cpu_vs_stock']:.2f}x) | "
                         f"{p['mean_bytes'] / 1e6:.2f} / {p['busiest_bytes'] / 1e6:.2f} |")
    lines += ["", f"Allocator: {malloc.described(results)}."]
    return lines


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["onehot", "multihot", "uniform"], choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--stats-batches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="out/candidates")
    a = ap.parse_args(argv)
    for name, value, low in (("world", a.world, 2), ("rows-cap", a.rows_cap, 1), ("stats-batches", a.stats_batches, 1),
                             ("warmup", a.warmup, 0), ("steps", a.steps, 1)):
        if value < low:
            ap.error(f"--{name} must be >= {low}, got {value}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    results = [run_one(w, a.world, a.rows_cap, a.stats_batches, a.warmup, a.steps) for w in a.workloads]
    print(write_results(a.out, "candidates", results, ["# Every candidate plan, trained", ""] + markdown(results)))
    return results


if __name__ == "__main__":
    main()
