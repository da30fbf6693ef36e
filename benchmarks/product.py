"""The product as a user meets it: the hybrid planner's plan against TorchRec's planner's plan.

Per workload and world size, in one gloo process group: frequency statistics are counted on
``--stats-batches`` batches of their own; ``HybridEmbeddingShardingPlanner`` and TorchRec's
``EmbeddingShardingPlanner`` each plan the same EBC (26 Criteo-Kaggle tables capped at
``--rows-cap``, dim 64, EXACT_ROWWISE_ADAGRAD) for the same topology
(``Topology(world_size=W, compute_device="cpu")``); both plans train on the same, other,
batches, step by step, the order of the plans balanced over steps (a Williams design: each
plan takes each position, and follows each other plan, equally often over each full cycle of
its orders, which starts at the first timed step; 40 steps of 3 plans, 6 orders: within one),
each step behind a barrier. The hybrid planner plans twice: as a user of this machine gets it (``hybrid_planner``:
compute priced by the CPU calibration, ``planner/compute_costs.py``) and as it plans for a
network-bound cluster (``hybrid_planner_bytes``: bytes and collectives only, the default on
CUDA). Per model: bytes each rank sends (``wchar`` of ``/proc/self/io``) - the mean over
ranks and the busiest rank - and the median over steps of the slowest rank's step time;
next to them the hybrid planner's own per-rank estimate of both plans, and the minor page faults
of a step (every rank runs with glibc's malloc thresholds fixed unless ``--malloc default``:
``benchmarks/malloc.py``).

Workloads: ``onehot`` (one id per feature, B=1024), ``multihot`` (MLPerf DLRMv2 bag sizes,
B=512), their ``sorted-`` variants (ids numbered by popularity) and ``uniform`` (one-hot,
uniform ids). Run: ``python -m benchmarks.product [--world 2 4 8] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from benchmarks import malloc
from benchmarks.measure import balanced_orders, ci_text, median_ci, slowest_rank

logger = logging.getLogger(__name__)

WORKLOADS = {
    "onehot": dict(multi_hot=False, alpha=1.1, sorted_ids=False, batch=1024),
    "multihot": dict(multi_hot=True, alpha=1.1, sorted_ids=False, batch=512),
    "sorted-onehot": dict(multi_hot=False, alpha=1.1, sorted_ids=True, batch=1024),
    "sorted-multihot": dict(multi_hot=True, alpha=1.1, sorted_ids=True, batch=512),
    "uniform": dict(multi_hot=False, alpha=0.0, sorted_ids=False, batch=1024),
}
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
    from benchmarks.data import rank_slice
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


def _rank_main(rank: int, world: int, emit, spec: Dict[str, Any], rows_cap: int, stats_batches: int,
               warmup: int, steps: int, prices: Optional[Any] = None, tie_ms: Any = "auto") -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from benchmarks.step_counts import count_training_step

    tables, stats, batches = workload_data(spec, world, rank, rows_cap, stats_batches, warmup + steps)
    planners, plans, models = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD, prices, tie_ms)
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    orders = balanced_orders(len(MODELS))
    measured = interleaved_steps(models, batches, warmup,  # orders balanced over the timed steps
                                 lambda i: [MODELS[j] for j in orders[(i - warmup) % len(orders)]])
    sent, times = measured["sent"], measured["wall"]
    dist.barrier()
    counts = {}
    for name in MODELS:  # one more, untimed, step per model under the op counter
        dist.barrier()
        counts[name] = count_training_step(models[name], batches[-1])
    out: Dict[str, Any] = {"sent": {m: sum(v) / len(v) for m, v in sent.items()}, "times": times,
                           "faults": measured["faults"], "counts": counts,
                           "spills": {m: cold_spills(models[m], len(batches) + 1) for m in MODELS}}
    if rank == 0:
        out.update(_planner_report(planners, plans), allocator=malloc.current())
    emit(out)


def cold_spills(model: Any, steps: int) -> List[int]:
    """``[spilled, exchanges]``: of the ``exchanges`` (``steps`` x cold all-to-alls per step) the model's
    hybrid sharded modules ran, how many outgrew their rooms and took a second all-to-all (every
    rank sees the same spill flag, so every rank counts the same)."""
    from torchrec_hybrid import HybridShardedEmbeddingBagCollection

    cold = [c for m in model.modules() if isinstance(m, HybridShardedEmbeddingBagCollection)
            for c in m.cold_exchanges()]
    return [sum(c.spills for c in cold), len(cold) * steps]


def plan_models(tables, stats, spec: Dict[str, Any], world: int, pg, prices: Optional[Any] = None,
                 tie_ms: Any = "auto"):
    """Plan the EBC with the hybrid planner (both pricings) and TorchRec's planner for the same topology; the
    hybrid planners, the plans and a DistributedModelParallel per plan, by model name. ``prices``: the
    CPU-priced planner's ``ComputeCosts`` instead of the machine's default (None: the default); ``tie_ms``: its
    tie band (the planner's argument; the network-priced planner has none)."""
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
                                                  tie_ms=tie_ms if HYBRID_MODELS[m] == "default" else 0.0)
                for m, costs in priced.items()}
    plans = {m: p.collective_plan(ebc(), [hyb_sharder], pg) for m, p in planners.items()}
    stock_sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused))
    plans["stock_planner"] = EmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"]).collective_plan(
        ebc(), [stock_sharder], pg)
    models = {name: DistributedModelParallel(ebc(), device=torch.device("cpu"), plan=plans[name],
                                             sharders=[hyb_sharder if name in HYBRID_MODELS else stock_sharder])
              for name in MODELS}
    return planners, plans, models


def _timed_step(model: Any, kjt: Any) -> Tuple[float, float, int, Optional[int]]:
    """One training step of ``model`` behind a barrier: its wall seconds, process CPU seconds, bytes sent and
    minor page faults (``malloc.minor_faults``; None where they are not counted)."""
    import torch.distributed as dist

    from benchmarks.models import training_loss
    from torchrec_hybrid.comm_bytes import sent_bytes

    dist.barrier()
    f0, b0, c0, t0 = malloc.minor_faults(), sent_bytes(), time.process_time(), time.perf_counter()
    training_loss(model(kjt).wait().values()).backward()
    t1, c1, b1, f1 = time.perf_counter(), time.process_time(), sent_bytes(), malloc.minor_faults()
    return t1 - t0, c1 - c0, b1 - b0, malloc.faults_between(f0, f1)


def step_models(models: Dict[str, Any], names, kjt, i: int, timed: bool, sent: Dict[str, List[int]],
                times: Dict[str, List[float]]) -> None:
    """One training step of each of ``names``, in the order of row ``i`` of a Williams design
    (``measure.balanced_orders``: over its rows every model takes every position, and follows every other
    model, equally often; ``i``: counted from the first timed step, so the timed steps start a cycle), each
    behind a barrier; on a timed step, record each model's bytes sent and time."""
    names = tuple(names)
    orders = balanced_orders(len(names))
    for name in (names[j] for j in orders[i % len(orders)]):
        wall, _, nbytes, _ = _timed_step(models[name], kjt)
        if timed:
            sent[name].append(nbytes)
            times[name].append(wall)


def interleaved_steps(models: Dict[str, Any], batches: List[Any], warmup: int,
                      order: Callable[[int], List[str]]) -> Dict[str, Dict[str, List[Any]]]:
    """One training step of each model per batch, in the order ``order(i)`` gives for batch ``i``, each
    behind a barrier; per model, over the steps after the ``warmup`` first: wall seconds, process CPU
    seconds, bytes sent and page faults (``{"wall": .., "cpu": .., "sent": .., "faults": ..}``, each
    ``{model: [per step]}``)."""
    keys = ("wall", "cpu", "sent", "faults")
    out: Dict[str, Dict[str, List[Any]]] = {k: {n: [] for n in models} for k in keys}
    for i, kjt in enumerate(batches):
        for n in order(i):
            measured = _timed_step(models[n], kjt)
            if i >= warmup:
                for key, value in zip(keys, measured):
                    out[key][n].append(value)
    return out


def _planner_report(planners: Dict[str, Any], plans: Dict[str, Any]) -> Dict[str, Any]:
    """What the hybrid planners estimated (both plans' per-rank bytes), chose and compared, and each plan's
    table count per type: rank 0 reports them."""
    first = planners["hybrid_planner"]
    est = {c.name.split(":")[0]: c.rank_bytes for c in first.candidates}
    out: Dict[str, Any] = {"estimate": {m: p.estimated_rank_bytes() for m, p in planners.items()}}
    out["estimate"]["stock_planner"] = est.get("stock")
    out["chosen"] = {m: [c.name for c in p.candidates if c.plan is plans[m]][:1] or ["?"]
                     for m, p in planners.items()}
    out["comparison"] = {m: p.comparison_table() for m, p in planners.items()}
    out["types"] = {m: plan_types(p) for m, p in plans.items()}
    return out


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


def run_one(name: str, world: int, rows_cap: int, stats_batches: int, warmup: int, steps: int,
            prices: Optional[Any] = None, tie_ms: Any = "auto", repeats: int = 1,
            allocator: str = malloc.DEFAULT_MODE) -> Dict[str, Any]:
    """One workload at one world size, run ``repeats`` times, each in fresh processes (new allocations, new
    process group: between such runs the same pair of plans moves by more than within one). The steps of
    every run are pooled; bytes are the runs' mean; the planner's report and op counts are the first run's
    (the plans are the same each time: same statistics, deterministic planners). ``allocator``: the ranks'
    malloc mode (``benchmarks/malloc.py``)."""
    runs = []
    for _ in range(repeats):
        per_rank = malloc.spawn_ranks(_rank_main, world, malloc=allocator, timeout=3000, spec=WORKLOADS[name],
                                      rows_cap=rows_cap, stats_batches=stats_batches, warmup=warmup, steps=steps,
                                      prices=prices, tie_ms=tie_ms)
        runs.append([items[0] for items in per_rank])
        if runs[-1][0]["types"] != runs[0][0]["types"]:
            raise RuntimeError(f"{name} W={world}: the planners returned other plans in run {len(runs)} "
                               f"({runs[-1][0]['types']}) than in run 1 ({runs[0][0]['types']})")
    outs = runs[0]
    r0 = outs[0]
    res: Dict[str, Any] = {"workload": name, "world": world, "batch": WORKLOADS[name]["batch"], "repeats": repeats,
                           "allocator": r0["allocator"], "chosen": r0["chosen"], "types": r0["types"],
                           "comparison": r0["comparison"]}
    for m in MODELS:
        sent = [statistics.mean(run[r]["sent"][m] for run in runs) for r in range(world)]
        step = [t for run in runs for t in slowest_rank([o["times"][m] for o in run])]
        est = r0["estimate"][m]
        res[m] = {"sent_per_rank": sent, "mean_bytes": sum(sent) / world, "busiest_bytes": max(sent),
                  "median_step_s": statistics.median(step),
                  # per step the rank with the most, median over every run's steps
                  "page_faults_per_step": malloc.busiest_median(
                      [[f for run in runs for f in run[r]["faults"][m]] for r in range(world)]),
                  "estimate_per_rank": est,
                  "estimate_error_per_rank": None if not est else [e / s - 1 for e, s in zip(est, sent)],
                  # per step, the busiest rank's count (collectives are the same on every rank)
                  "counts": {k: max(o["counts"][m][k] for o in outs) for k in r0["counts"][m]},
                  # cold exchanges that outgrew their rooms, of those run, over every run (rank 0's: all alike)
                  "spills": [sum(run[0]["spills"][m][i] for run in runs) for i in (0, 1)]}
    s = res["stock_planner"]
    # per run and step, the plan's slowest rank over the stock planner's on the same batch
    paired = {m: [paired_step_ratios(run, m, "stock_planner") for run in runs] for m in HYBRID_MODELS}
    res["ratios"] = {m: {"busiest": res[m]["busiest_bytes"] / s["busiest_bytes"],
                         "mean": res[m]["mean_bytes"] / s["mean_bytes"],
                         "step": res[m]["median_step_s"] / s["median_step_s"],
                         # the median over every run's steps with its interval, and each run's own median
                         "paired_step_ci": median_ci([x for run in paired[m] for x in run]),
                         "paired_step_runs": [statistics.median(run) for run in paired[m]],
                         "busiest_over_mean": res[m]["busiest_bytes"] / res[m]["mean_bytes"]}
                     for m in HYBRID_MODELS}
    return res


def paired_step_ratios(outs: List[Dict[str, Any]], model: str, base: str) -> List[float]:
    """Per batch, ``model``'s step over ``base``'s on the same batch, each the slowest rank's (``outs``: per
    rank, ``{"times": {model: [per batch]}}``)."""
    ours, theirs = (slowest_rank([o["times"][m] for o in outs]) for m in (model, base))
    return [a / b for a, b in zip(ours, theirs)]


def paired_text(ratios: Dict[str, Any]) -> str:
    """A plan's paired step ratio (its ``ratios`` entry) as the reports print it: the pooled median and its
    interval, and with several runs the range of their own medians (``0.81x [0.79, 0.85] (runs 0.80-0.85)``);
    "-" for results older than the paired ratio."""
    if not ratios.get("paired_step_ci"):
        return "-"
    runs = ratios.get("paired_step_runs", [])
    spread = f" (runs {min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
    return ci_text(ratios["paired_step_ci"]) + spread


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    lines = ["| workload | W | plan | its types | busiest-rank MB: plan / stock | ratio | mean ratio "
             "| busiest/mean | median step ratio | per-step ratio: median [95% CI] (each run's median) "
             "| estimate error per rank (plan; stock) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    err = lambda e: "-" if not e else f"{min(e) * 100:+.0f}..{max(e) * 100:+.0f}%"  # noqa: E731
    for r in results:
        s = r["stock_planner"]
        for m in HYBRID_MODELS:
            h, q = r[m], r["ratios"][m]
            paired = paired_text(q)
            types = types_text(r["types"][m])
            lines.append(f"| {r['workload']} | {r['world']} | {m} | {types} | {h['busiest_bytes'] / 1e6:.2f} / "
                         f"{s['busiest_bytes'] / 1e6:.2f} | **{q['busiest']:.2f}x** | {q['mean']:.2f}x | "
                         f"{q['busiest_over_mean']:.2f} | {q['step']:.2f}x | {paired} | "
                         f"{err(h['estimate_error_per_rank'])}; {err(s['estimate_error_per_rank'])} |")
    lines += ["", "Per training step (forward / backward), counted by a dispatch hook "
              "(`benchmarks/step_counts.py`), busiest rank; minor page faults per timed step (the rank with the "
              "most, median over steps; `benchmarks/malloc.py`); cold spills: the hybrid cold-id all-to-alls "
              "that outgrew their rooms and took a second one, of all those run (warm-up included):", "",
              "| workload | W | plan | collectives | host syncs | ops dispatched | page faults | cold spills |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for m in MODELS:
            c, spills = r[m]["counts"], r[m].get("spills")
            spilled = "-" if not spills or not spills[1] else f"{spills[0]} of {spills[1]}"
            lines.append(f"| {r['workload']} | {r['world']} | {m} | {c['fwd_collectives']} / {c['bwd_collectives']} | "
                         f"{c['fwd_host_syncs']} / {c['bwd_host_syncs']} | {c['fwd_ops']} / {c['bwd_ops']} | "
                         f"{malloc.faults_text(r[m].get('page_faults_per_step'))} | {spilled} |")
    lines += ["", f"Allocator: {malloc.described(results)}."]
    return lines


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[4])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--stats-batches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per workload and world size, each in fresh processes; their steps are pooled")
    ap.add_argument("--malloc", choices=malloc.MODES, default=malloc.DEFAULT_MODE,
                    help="the ranks' C allocator: glibc's malloc thresholds fixed (default: no page faults from "
                         "blocks going back to the kernel between steps) or glibc's defaults (benchmarks/malloc.py)")
    ap.add_argument("--out", default="out/product")
    ap.add_argument("--prices", metavar="JSON",
                    help="the CPU-priced planner's prices: a calibration file of benchmarks/calibrate.py "
                         "(default: the machine's default prices, planner/compute_costs.py)")
    ap.add_argument("--tie-ms", default="auto", metavar="MS|fit_error|auto",
                    help="the CPU-priced planner's tie_ms: plans costed within it of the cheapest go to the fewest "
                         "bytes ('fit_error': the prices' RMS error; default 'auto', the planner's: their relative "
                         "error where they carry one, else 0)")
    a = ap.parse_args(argv)
    for name, value, low in (("world", min(a.world), 2), ("rows-cap", a.rows_cap, 1), ("stats-batches",
                             a.stats_batches, 1), ("warmup", a.warmup, 0), ("steps", a.steps, 1),
                             ("repeats", a.repeats, 1)):
        if value < low:  # one rank has nothing to compare; no steps, no median
            ap.error(f"--{name} must be >= {low}, got {value}")
    from torchrec_hybrid.planner.config import PlannerConfigError, parse_hot_set

    try:  # the YAML's rule for the same key, so a bad value fails here, not in every rank
        tie_ms: Any = parse_hot_set({"tie_ms": a.tie_ms if a.tie_ms in ("fit_error", "auto") else float(a.tie_ms)},
                                    "--tie-ms")["tie_ms"]
    except (ValueError, PlannerConfigError) as e:
        ap.error(f"--tie-ms: expected a finite number of ms >= 0, 'fit_error' or 'auto', got {a.tie_ms!r} ({e})")
    from torchrec_hybrid.planner.compute_costs import load_calibration

    prices = load_calibration(a.prices) if a.prices else None  # read once; a bad file fails before any rank starts
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    os.makedirs(a.out, exist_ok=True)
    results = []
    for w in a.world:
        for name in a.workloads:
            t = time.time()
            results.append(run_one(name, w, a.rows_cap, a.stats_batches, a.warmup, a.steps, prices, tie_ms,
                                   a.repeats, a.malloc))
            r = results[-1]
            for m, q in r["ratios"].items():
                logger.info("%s W=%d %s: busiest %.2fx, mean %.2fx, step %.2fx (%.0f s)", name, w, m,
                            q["busiest"], q["mean"], q["step"], time.time() - t)
            with open(os.path.join(a.out, "product.json"), "w") as f:
                json.dump({"args": vars(a), "results": results}, f, indent=1)
    with open(os.path.join(a.out, "product.md"), "w") as f:
        f.write("\n".join(markdown(results)) + "\n")
    print("\n".join(markdown(results)))
    return results


if __name__ == "__main__":
    main()
