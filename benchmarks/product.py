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

Where bytes cost time: ``--network 500mbit 2gbit 8gbit`` runs every workload at each rate, the
ranks of a shaped rate inside a network namespace whose loopback a token bucket shapes to it
(``benchmarks/shaped_loopback.py``: this module re-execs itself there with the same arguments,
one process per rate, and merges the results); ``unshaped`` among them runs on the plain
loopback as before. With a shaped rate the ranks measure their network before planning
(``torchrec_hybrid.planner.measure_network``: after the statistics, before any plan) and both
planners plan for it: TorchRec's for ``measurement.apply_to(topology)``, the hybrid planner with
``network=measurement``; ``--measure-network`` does so on unshaped runs alone too. The results
then carry the measurement per rate and, per workload, the rate above which the stock plan steps
faster than the hybrid planner's (:func:`crossover`).

Every rank runs one intra-op thread (``torch.set_num_threads(1)``) unless ``--threads N``: N threads per
rank, ``0`` torch's default (``set_num_threads`` not called); the results record it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from benchmarks import malloc, shaped_loopback
from benchmarks.measure import balanced_orders, median_ci, paired_text, slowest_rank
from benchmarks.shaped_loopback import (MEASURE, UNSHAPED, network_record, network_table, network_tag,
                                        networked, resolve_network)
from benchmarks.spawner import spawn_ranks
from benchmarks.stepping import add_threads_argument, interleaved_steps, set_threads, threads_text
from benchmarks.step_counts import count_training_step
from benchmarks.workloads import HYBRID_MODELS, MODELS, WORKLOADS, plan_models, plan_types, types_text, workload_data

logger = logging.getLogger(__name__)


def _rank_main(rank: int, world: int, emit, spec: Dict[str, Any], rows_cap: int, stats_batches: int,
               warmup: int, steps: int, prices: Optional[Any] = None, tie_ms: Any = "auto",
               network: Any = None, threads: int = 1) -> None:
    """One rank of :func:`run_one`. ``network``: None (the planners' default topology), :data:`MEASURE` (measure
    it here, every rank, after the statistics and before planning) or a ``NetworkMeasurement`` to plan for;
    ``threads``: its intra-op threads (:func:`set_threads`)."""
    torch_threads = set_threads(threads)
    import torch.distributed as dist

    tables, stats, batches = workload_data(spec, world, rank, rows_cap, stats_batches, warmup + steps)
    network = resolve_network(network, dist.GroupMember.WORLD)
    planners, plans, models = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD, prices, tie_ms,
                                          network)
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
                           "faults": measured["faults"], "cpu": measured["cpu"], "counts": counts,
                           "spills": {m: cold_spills(models[m], len(batches) + 1) for m in MODELS},
                           "torch_threads": torch_threads}
    if rank == 0:
        out.update(_planner_report(planners, plans), allocator=malloc.current(), network=network)
    emit(out)


def cold_spills(model: Any, steps: int) -> List[int]:
    """``[spilled, exchanges]``: of the ``exchanges`` (``steps`` x cold all-to-alls per step) the model's
    hybrid sharded modules ran, how many outgrew their rooms and took a second all-to-all (every
    rank sees the same spill flag, so every rank counts the same)."""
    from torchrec_hybrid import HybridShardedEmbeddingBagCollection

    cold = [c for m in model.modules() if isinstance(m, HybridShardedEmbeddingBagCollection)
            for c in m.cold_exchanges()]
    return [sum(c.spills for c in cold), len(cold) * steps]


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


def run_one(name: str, world: int, rows_cap: int, stats_batches: int, warmup: int, steps: int,
            prices: Optional[Any] = None, tie_ms: Any = "auto", repeats: int = 1,
            allocator: str = malloc.DEFAULT_MODE, network: Any = None, rate: str = UNSHAPED,
            threads: int = 1) -> Dict[str, Any]:
    """One workload at one world size, run ``repeats`` times, each in fresh processes (new allocations, new
    process group: between such runs the same pair of plans moves by more than within one). The steps of
    every run are pooled; bytes are the runs' mean; the planner's report and op counts are the first run's
    (the plans are the same each time: same statistics, deterministic planners). ``allocator``: the ranks'
    malloc mode (``benchmarks/malloc.py``). ``network``: :data:`MEASURE` to plan for the network the first run's
    ranks measure (later runs plan for that same measurement: the same plans, so their steps pool), None for
    the default topology; ``rate``: the loopback's shaped rate the ranks run at, recorded (:func:`network_record`);
    ``threads``: each rank's intra-op threads (:func:`set_threads`), recorded with the count torch ran."""
    runs = []
    for _ in range(repeats):
        per_rank = spawn_ranks(_rank_main, world, malloc=allocator, timeout=3000, spec=WORKLOADS[name],
                                      rows_cap=rows_cap, stats_batches=stats_batches, warmup=warmup, steps=steps,
                                      prices=prices, tie_ms=tie_ms, network=network, threads=threads)
        runs.append([items[0] for items in per_rank])
        network = runs[0][0]["network"]  # the first run's measurement (or None) for the runs after it
        if runs[-1][0]["types"] != runs[0][0]["types"]:
            raise RuntimeError(f"{name} W={world}: the planners returned other plans in run {len(runs)} "
                               f"({runs[-1][0]['types']}) than in run 1 ({runs[0][0]['types']})")
    outs = runs[0]
    r0 = outs[0]
    res: Dict[str, Any] = {"workload": name, "world": world, "batch": WORKLOADS[name]["batch"], "repeats": repeats,
                           "allocator": r0["allocator"], "chosen": r0["chosen"], "types": r0["types"],
                           "comparison": r0["comparison"], "network": network_record(rate, r0["network"], world),
                           "threads": threads, "torch_threads": r0["torch_threads"],
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    for m in MODELS:
        sent = [statistics.mean(run[r]["sent"][m] for run in runs) for r in range(world)]
        step = [t for run in runs for t in slowest_rank([o["times"][m] for o in run])]
        est = r0["estimate"][m]
        res[m] = {"sent_per_rank": sent, "mean_bytes": sum(sent) / world, "busiest_bytes": max(sent),
                  "median_step_s": statistics.median(step),
                  # per step the process CPU summed over ranks (what the ranks' work costs the machine), median
                  "cpu_per_step_s": statistics.median(
                      sum(per_rank) for run in runs for per_rank in zip(*(o["cpu"][m] for o in run))),
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


def cpu_text(r: Dict[str, Any], m: str) -> str:
    """A plan's process CPU per step (summed over ranks) and its ratio to the stock plan's ("-" before it was
    recorded)."""
    cpu, base = r[m].get("cpu_per_step_s"), r["stock_planner"].get("cpu_per_step_s")
    if cpu is None or not base:
        return "-"
    return f"{cpu * 1e3:.1f} ({cpu / base:.2f}x)"


def paired_step_ratios(outs: List[Dict[str, Any]], model: str, base: str) -> List[float]:
    """Per batch, ``model``'s step over ``base``'s on the same batch, each the slowest rank's (``outs``: per
    rank, ``{"times": {model: [per batch]}}``)."""
    ours, theirs = (slowest_rank([o["times"][m] for o in outs]) for m in (model, base))
    return [a / b for a, b in zip(ours, theirs)]


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    """The report: the plans' bytes and step ratios, their op counts; on a shaped or measured network each row
    also names its rate, and :func:`network_markdown` follows."""
    net = networked(results)
    col, rule = ("| network ", "|---") if net else ("", "")
    cell = (lambda r: f"| {r['network']['rate']} ") if net else (lambda r: "")  # noqa: E731
    lines = [col + "| workload | W | plan | its types | busiest-rank MB: plan / stock | ratio | mean ratio "
             "| busiest/mean | median step ratio | per-step ratio: median [95% CI] (each run's median) "
             "| estimate error per rank (plan; stock) |",
             rule + "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    err = lambda e: "-" if not e else f"{min(e) * 100:+.0f}..{max(e) * 100:+.0f}%"  # noqa: E731
    for r in results:
        s = r["stock_planner"]
        for m in HYBRID_MODELS:
            h, q = r[m], r["ratios"][m]
            paired = paired_text(q)
            types = types_text(r["types"][m])
            lines.append(f"{cell(r)}| {r['workload']} | {r['world']} | {m} | {types} | "
                         f"{h['busiest_bytes'] / 1e6:.2f} / "
                         f"{s['busiest_bytes'] / 1e6:.2f} | **{q['busiest']:.2f}x** | {q['mean']:.2f}x | "
                         f"{q['busiest_over_mean']:.2f} | {q['step']:.2f}x | {paired} | "
                         f"{err(h['estimate_error_per_rank'])}; {err(s['estimate_error_per_rank'])} |")
    lines += ["", "Per training step (forward / backward), counted by a dispatch hook "
              "(`benchmarks/step_counts.py`), busiest rank; minor page faults per timed step (the rank with the "
              "most, median over steps; `benchmarks/malloc.py`); cold spills: the hybrid cold-id all-to-alls "
              "that outgrew their rooms and took a second one, of all those run (warm-up included); process CPU: "
              "per timed step summed over ranks (median over steps), and over the stock plan's:", "",
              col + "| workload | W | plan | collectives | host syncs | ops dispatched | page faults | cold spills "
              "| process CPU, ms |",
              rule + "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for m in MODELS:
            c, spills = r[m]["counts"], r[m].get("spills")
            spilled = "-" if not spills or not spills[1] else f"{spills[0]} of {spills[1]}"
            lines.append(f"{cell(r)}| {r['workload']} | {r['world']} | {m} | {c['fwd_collectives']} / "
                         f"{c['bwd_collectives']} | "
                         f"{c['fwd_host_syncs']} / {c['bwd_host_syncs']} | {c['fwd_ops']} / {c['bwd_ops']} | "
                         f"{malloc.faults_text(r[m].get('page_faults_per_step'))} | {spilled} | {cpu_text(r, m)} |")
    lines += ["", f"Allocator: {malloc.described(results)}.", "", f"Intra-op threads: {threads_text(results)}."]
    if net:
        lines += [""] + network_markdown(results)
    return lines


def network_markdown(results: List[Dict[str, Any]]) -> List[str]:
    """The network each result ran on (:func:`network_table`), per rate both plans side by side (types, bytes,
    median step, paired ratio), and per workload the :func:`crossover` of the rates run."""
    lines = network_table(results)
    lines += ["", "## Plans per network", "", "Each plan's tables per type, the bytes a rank sends per step (mean "
              "and busiest rank, MB), the median of the slowest rank's step, and its step over the stock plan's on "
              "the same batches (median [95% CI]):", "",
              "| network | workload | W | plan | its types | MB per rank: mean / busiest | busiest vs stock "
              "| median step ms | per-step ratio vs stock |", "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in results:
        s = r["stock_planner"]
        for m in MODELS:
            h = r[m]
            ratio = "1" if m == "stock_planner" else f"{h['busiest_bytes'] / s['busiest_bytes']:.2f}x"
            paired = "-" if m == "stock_planner" else paired_text(r["ratios"][m])
            lines.append(f"| {r['network']['rate']} | {r['workload']} | {r['world']} | {m} | "
                         f"{types_text(r['types'][m])} | {h['mean_bytes'] / 1e6:.2f} / {h['busiest_bytes'] / 1e6:.2f} "
                         f"| {ratio} | {h['median_step_s'] * 1e3:.1f} | {paired} |")
    lines += ["", "## Crossover", "", "Per workload, W and hybrid plan: the rate above which the stock planner's "
              "plan steps faster than the hybrid planner's, interpolated on log rate between the two rates run "
              "where the paired step ratio crosses 1.0:", "",
              "| workload | W | plan | per-step ratio vs stock by rate | stock faster above |",
              "|---|---:|---|---|---|"]
    for c in crossovers(results):
        points = ", ".join(f"{p['rate']} {p['ratio']:.2f}x" for p in c["points"])
        lines.append(f"| {c['workload']} | {c['world']} | {c['plan']} | {points} | {c['text']} |")
    return lines


def crossover(points: Sequence[Tuple[str, Sequence[float]]]) -> Dict[str, Any]:
    """Where a hybrid plan's paired step ratio (its step over the stock plan's) crosses 1.0 over the rates run.

    ``points``: ``(rate, (lo, median, hi))`` per rate (``shaped_loopback.parse_rate`` spelling; ``unshaped``
    counts as faster than any shaped rate). Sorted by rate, the last pair of neighbours whose medians lie on
    either side of 1.0 gives the crossover, interpolated linearly in the ratio on log rate: fewer bytes pay
    where bytes are slow, so the hybrid plan is expected faster below it and the stock plan above it. Returns
    ``rate_bits_per_s`` (None: no crossing, or one next to ``unshaped``), ``stock_faster`` ("above" / "below" the
    crossover, "at every rate", "at no rate" or None with one rate), ``text`` for the reports, and the sorted
    ``points`` as ``{"rate", "ratio", "ci"}``."""
    pts = sorted(({"rate": rate, "ratio": ci[1], "ci": list(ci)} for rate, ci in points),
                 key=lambda p: shaped_loopback.rate_bits(p["rate"]))
    out: Dict[str, Any] = {"rate_bits_per_s": None, "stock_faster": None, "points": pts}
    if len(pts) < 2:
        return dict(out, text="one rate run: no crossover" if pts else "no rate run")
    stock = [p["ratio"] >= 1.0 for p in pts]  # the stock plan at least as fast
    crossings = [i for i in range(len(pts) - 1) if stock[i] != stock[i + 1]]
    span = f"{pts[0]['rate']} to {pts[-1]['rate']}"
    if not crossings:
        if stock[0]:
            return dict(out, stock_faster="at every rate",
                        text=f"below all rates run (the stock plan stepped faster at every rate, {span})")
        return dict(out, stock_faster="at no rate",
                    text=f"above all rates run (the hybrid plan stepped faster at every rate, {span})")
    i = crossings[-1]
    a, b = pts[i], pts[i + 1]
    xa, xb = (shaped_loopback.rate_bits(p["rate"]) for p in (a, b))
    upward = stock[i + 1]  # hybrid faster below, stock faster above
    between = f"{a['rate']} {a['ratio']:.2f}x, {b['rate']} {b['ratio']:.2f}x"
    if math.isinf(xb):
        where = f"between {a['rate']} and {b['rate']}"
    else:
        t = (1.0 - a["ratio"]) / (b["ratio"] - a["ratio"])
        out["rate_bits_per_s"] = math.exp(math.log(xa) + t * (math.log(xb) - math.log(xa)))
        where = f"~{shaped_loopback.rate_text(out['rate_bits_per_s'])}"
    out["stock_faster"] = "above" if upward else "below"
    text = (f"{where} ({between})" if upward
            else f"none: the stock plan stepped faster below {where}, the hybrid plan above it ({between})")
    if any(p["ci"][0] <= 1.0 <= p["ci"][2] for p in (a, b)):
        text += "; unresolved: an interval there holds 1.0"
    if len(crossings) > 1:
        text += f"; the ratio crosses 1.0 {len(crossings)} times over the rates run"
    return dict(out, text=text)


def crossovers(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """:func:`crossover` per workload, W and hybrid plan, over the rates the results ran at (in the order the
    results first name each workload and W)."""
    groups: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["workload"], r["world"]), []).append(r)
    return [dict(crossover([(r["network"]["rate"], r["ratios"][m]["paired_step_ci"]) for r in rs]),
                 workload=name, world=world, plan=m)
            for (name, world), rs in groups.items() for m in HYBRID_MODELS]


def write_json(path: str, args: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
    """The results file: the arguments, every result and, on a shaped or measured network, the crossovers."""
    data: Dict[str, Any] = {"args": args, "results": results}
    if networked(results):
        data["crossover"] = crossovers(results)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def summary(results: List[Dict[str, Any]]) -> List[str]:
    """The end of a run's terminal output: per result and hybrid plan its byte and step ratios to the stock plan
    (and the network it ran on), then the crossovers where more than one rate ran."""
    lines = []
    for r in results:
        net = network_tag(results, r)
        for p, q in r["ratios"].items():
            lines.append(f"{r['workload']} W={r['world']} {p}{net}: busiest bytes {q['busiest']:.2f}x, mean "
                         f"{q['mean']:.2f}x, per-step {paired_text(q)} the stock plan's")
    if len({r["network"]["rate"] for r in results if "network" in r}) > 1:
        lines += [f"crossover {c['workload']} W={c['world']} {c['plan']} (the stock plan faster above): {c['text']}"
                  for c in crossovers(results)]
    return lines


def main(argv=None) -> List[Dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)  # a shaped rate's process gets the same arguments
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
    shaped_loopback.add_arguments(ap)
    add_threads_argument(ap)
    a = ap.parse_args(argv)
    for name, value, low in (("world", min(a.world), 2), ("rows-cap", a.rows_cap, 1), ("stats-batches",
                             a.stats_batches, 1), ("warmup", a.warmup, 0), ("steps", a.steps, 1),
                             ("repeats", a.repeats, 1), ("threads", a.threads, 0)):
        if value < low:  # one rank has nothing to compare; no steps, no median; no fewer than 0 threads
            ap.error(f"--{name} must be >= {low}, got {value}")
    from torchrec_hybrid.planner.config import PlannerConfigError, parse_hot_set

    try:  # the YAML's rule for the same key, so a bad value fails here, not in every rank
        tie_ms: Any = parse_hot_set({"tie_ms": a.tie_ms if a.tie_ms in ("fit_error", "auto") else float(a.tie_ms)},
                                    "--tie-ms")["tie_ms"]
    except (ValueError, PlannerConfigError) as e:
        ap.error(f"--tie-ms: expected a finite number of ms >= 0, 'fit_error' or 'auto', got {a.tie_ms!r} ({e})")
    # before any rank starts: the rates, the tools, the namespace, tc's own reading
    rates, inside, measure = shaped_loopback.rates_to_run(ap, a.network, a.measure_network)
    from torchrec_hybrid.planner.compute_costs import load_calibration

    prices = load_calibration(a.prices) if a.prices else None  # read once; a bad file fails before any rank starts
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    out = shaped_loopback.out_dir(a.out, inside)
    os.makedirs(out, exist_ok=True)

    def run_here(rate: str) -> Iterator[Dict[str, Any]]:
        for w in a.world:
            for name in a.workloads:
                t = time.time()
                r = run_one(name, w, a.rows_cap, a.stats_batches, a.warmup, a.steps, prices, tie_ms, a.repeats,
                            a.malloc, MEASURE if measure else None, rate, a.threads)
                for m, q in r["ratios"].items():
                    logger.info("%s%s W=%d %s: busiest %.2fx, mean %.2fx, step %.2fx (%.0f s)",
                                "" if rate == UNSHAPED else rate + " ", name, w, m, q["busiest"], q["mean"],
                                q["step"], time.time() - t)
                yield r

    results = shaped_loopback.run_rates(rates, inside, "benchmarks.product", argv, a.out, "product.json", run_here,
                                        lambda rs: write_json(os.path.join(out, "product.json"), vars(a), rs))
    with open(os.path.join(out, "product.md"), "w") as f:
        f.write("\n".join(markdown(results)) + "\n")
    if inside is None:  # a shaped rate's process leaves the report to the run that started it
        print("\n".join(markdown(results)))
        for line in summary(results):
            logger.info("%s", line)
    return results


if __name__ == "__main__":
    main()
