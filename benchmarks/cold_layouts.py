"""Cold layouts of the heaviest table: what spreading its cold lookups costs per step.

The network-priced hybrid plan (``benchmarks/product.py``, ``hybrid_planner_bytes``) lays out
each table's cold rows to minimise bytes; on DLRMv2 multi-hot bags its heaviest table (the
one with the most lookups: t_cat_20, 100 ids per bag) gets table-wise cold, so one rank does
all of its cold lookups. This benchmark checks whether spreading them would pay: the same plan
with that table switched to each other cold layout (row-wise: even row blocks on every rank;
column-wise: one column slice per rank), its hot ids kept, against the plan as returned and
TorchRec's planner's plan. One gloo process group, the same batches, one step of each plan
per round in a rotated order behind a barrier. Per plan: the median over steps of each rank's
process CPU, their sum, the median of the slowest rank's step, and the bytes each rank sends
(``/proc/self/io``; mean and busiest rank).

    python -m benchmarks.cold_layouts                          # W=4, multihot, ~2 min here
    python -m benchmarks.cold_layouts --out benchmarks/results # the committed run
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
from typing import Any, Dict, List

import torch

from benchmarks.stepping import interleaved_steps
from benchmarks.workloads import WORKLOADS, fused_params, plan_models, workload_data
from benchmarks.report import write_results
from benchmarks import malloc
from benchmarks.spawner import spawn_ranks

logger = logging.getLogger(__name__)

BASE = "hybrid_planner_bytes"
LAYOUTS = ("table_wise", "row_wise", "column_wise")


def heaviest_table(plan, stats) -> str:
    """The frequency_hybrid table of ``plan`` with the most lookups in ``stats``."""
    from torchrec_hybrid.types import FREQUENCY_HYBRID

    hybrid = [n for mp in plan.plan.values() for n, ps in mp.items() if ps.sharding_type == FREQUENCY_HYBRID]
    return max(hybrid, key=stats.lookups)


def with_cold_layout(plan, tables, name: str, layout: str, world: int):
    """``plan`` with table ``name`` switched to ``layout`` cold (table-wise: on the rank after its
    current owner's; column-wise: one slice per rank), its hot ids and pooling factor kept."""
    from torchrec_hybrid.planner.types import HybridParameterSharding
    from torchrec_hybrid.sharding_plan import frequency_hybrid

    out = copy.deepcopy(plan)
    module_plan = next(mp for mp in out.plan.values() if name in mp)
    old = module_plan[name]
    cfg = next(t for t in tables if t.name == name)
    kw: Dict[str, Any] = {"cold": layout}
    if layout == "table_wise":
        sizes = [s.shard_sizes[0] for s in old.sharding_spec.shards]
        kw["rank"] = (max(range(world), key=sizes.__getitem__) + 1) % world
    elif layout == "column_wise":
        kw["ranks"] = list(range(world))
    ps = frequency_hybrid(**kw)(torch.empty(cfg.num_embeddings, cfg.embedding_dim), 1, world, "cpu", None)
    module_plan[name] = HybridParameterSharding.from_stock(ps, ranks=list(range(world)), hot_ids=old.hot_ids.clone(),
                                                           hot_rows=old.hot_rows, cold_layout=layout,
                                                           pooling_factor=old.pooling_factor)
    return out


def _rank_main(rank: int, world: int, emit, workload: str, rows_cap: int, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    spec = WORKLOADS[workload]
    tables, stats, batches = workload_data(spec, world, rank, rows_cap, 8, warmup + steps)
    _, plans, models = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD)
    name = heaviest_table(plans[BASE], stats)
    current = next(mp[name] for mp in plans[BASE].plan.values() if name in mp).cold_layout
    fused = fused_params()
    sharder = HybridEmbeddingBagCollectionSharder(fused_params=fused)
    names = [f"{BASE} ({current} cold)", "stock_planner"]
    models = {names[0]: models[BASE], "stock_planner": models["stock_planner"]}
    for layout in LAYOUTS:
        if layout != current:
            names.append(f"{name} {layout} cold")
            models[names[-1]] = DistributedModelParallel(
                torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta")), device=torch.device("cpu"),
                plan=with_cold_layout(plans[BASE], tables, name, layout, world), sharders=[sharder])
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    measured = interleaved_steps(models, batches, warmup,  # the order rotates every step
                                 lambda i: names[i % len(names):] + names[:i % len(names)])
    emit(dict(measured, table=name, names=names, allocator=malloc.current()))


def run(workload: str, world: int, rows_cap: int, warmup: int, steps: int) -> Dict[str, Any]:
    outs = [items[0] for items in spawn_ranks(_rank_main, world, timeout=3000, workload=workload,
                                                     rows_cap=rows_cap, warmup=warmup, steps=steps)]
    r0 = outs[0]
    plans = {}
    for n in r0["names"]:
        cpu = [statistics.median(o["cpu"][n]) * 1e3 for o in outs]
        sent = [sum(o["sent"][n]) / len(o["sent"][n]) for o in outs]
        step = [max(o["wall"][n][i] for o in outs) for i in range(len(r0["wall"][n]))]
        plans[n] = {"cpu_ms_per_rank": cpu, "cpu_ms_sum": sum(cpu), "median_step_ms": statistics.median(step) * 1e3,
                    "mean_bytes": sum(sent) / world, "busiest_bytes": max(sent)}
    s = plans["stock_planner"]
    for p in plans.values():
        p["step_vs_stock"] = p["median_step_ms"] / s["median_step_ms"]
        p["cpu_sum_vs_stock"] = p["cpu_ms_sum"] / s["cpu_ms_sum"]
    return {"workload": workload, "world": world, "rows_cap": rows_cap, "warmup": warmup, "steps": steps,
            "allocator": r0["allocator"], "table": r0["table"], "plans": plans}


def markdown(res: Dict[str, Any]) -> List[str]:
    lines = [f"# Cold layouts of the heaviest table ({res['table']}): {res['workload']}, W={res['world']}, "
             f"{res['steps']} interleaved steps; allocator: "
             f"{res.get('allocator', malloc.UNRECORDED)}", "",
             "| plan | process CPU per rank, ms | sum | vs stock | median step, ms | vs stock "
             "| MB / rank (mean / busiest) |", "|---|---|---:|---:|---:|---:|---:|"]
    for n, p in res["plans"].items():
        lines.append(f"| {n} | {' / '.join(f'{x:.1f}' for x in p['cpu_ms_per_rank'])} | {p['cpu_ms_sum']:.1f} | "
                     f"{p['cpu_sum_vs_stock']:.2f}x | {p['median_step_ms']:.1f} | {p['step_vs_stock']:.2f}x | "
                     f"{p['mean_bytes'] / 1e6:.2f} / {p['busiest_bytes'] / 1e6:.2f} |")
    return lines


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workload", default="multihot", choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="out/cold_layouts")
    a = ap.parse_args(argv)
    if a.world < 2 or a.steps < 1 or a.warmup < 0:
        ap.error(f"--world must be >= 2 and --steps >= 1, --warmup >= 0 (got {a.world}, {a.steps}, {a.warmup})")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    res = run(a.workload, a.world, a.rows_cap, a.warmup, a.steps)
    print(write_results(a.out, "cold_layouts", res, markdown(res)))
    return res


if __name__ == "__main__":
    main()
