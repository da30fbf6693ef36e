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

Per pricing it also says whether the plan the planner returned stepped about as fast as the fastest
candidate it weighed: the returned plan's median step over the fastest one's (``returned vs
fastest``), within :data:`WITHIN` (5%) or not.

Where bytes cost time: ``--network 500mbit 2gbit unshaped`` runs every workload at each rate as
``benchmarks/product.py`` does (``benchmarks/shaped_loopback.py``: a shaped rate's ranks in a
network namespace whose loopback is shaped to it, this module re-run there; the results of all
rates in one file); with a shaped rate (or ``--measure-network``) the ranks measure the network
after the statistics (``measure_network``) and both planners plan for the measurement.
``--threads N``: each rank's intra-op threads (default 1; 0: torch's default), as the product's.

    python -m benchmarks.candidates                                      # W=4, onehot + multihot + uniform
    python -m benchmarks.candidates --out benchmarks/results             # the committed run
    python -m benchmarks.candidates --network 500mbit 2gbit 8gbit unshaped --out out/candidates_network
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Dict, Iterator, List, Tuple

import torch

from benchmarks import malloc, shaped_loopback
from benchmarks.measure import balanced_orders, ci_text, median_ci, slowest_rank
from benchmarks.shaped_loopback import (MEASURE, UNSHAPED, gbit, network_record, network_table, network_tag,
                                        networked, resolve_network)
from benchmarks.spawner import spawn_ranks
from benchmarks.stepping import add_threads_argument, interleaved_steps, set_threads, threads_text
from benchmarks.workloads import (HYBRID_MODELS, WORKLOADS, fused_params, plan_models, plan_types, types_text,
                                  workload_data)

logger = logging.getLogger(__name__)

STOCK = "stock: TorchRec's EmbeddingShardingPlanner"  # the name the planner gives TorchRec's plan
MIXED = "hybrid planner: stock + hybrid options"  # ... and its partitioner's plan over both kinds of options
ALL_HYBRID = "every eligible table frequency_hybrid"  # ... and the plan with every table it can hybrid
SHORT = {STOCK: "stock", MIXED: "mixed", ALL_HYBRID: "all-hybrid"}  # the names the terminal lines use
WITHIN = 1.05  # a returned plan whose median step is within 5% of the fastest candidate's chose well
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
               steps: int, network: Any = None, threads: int = 1) -> None:
    """One rank of :func:`run_one`; ``network`` and ``threads`` as the product's ranks take them
    (``shaped_loopback.resolve_network``: :data:`~benchmarks.shaped_loopback.MEASURE` measures it here, after
    the statistics)."""
    torch_threads = set_threads(threads)
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    spec = WORKLOADS[workload]
    tables, stats, batches = workload_data(spec, world, rank, rows_cap, stats_batches, warmup + steps)
    network = resolve_network(network, dist.GroupMember.WORLD)  # both planners (and TorchRec's) plan for it
    planners, returned = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD,
                                     network=network)[:2]  # (its models unused)
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
              returned={m: plan_types(returned[m]) for m in HYBRID_MODELS}, allocator=malloc.current(),
              network=network if rank == 0 else None, torch_threads=torch_threads))


def run_one(workload: str, world: int, rows_cap: int, stats_batches: int, warmup: int, steps: int,
            network: Any = None, rate: str = UNSHAPED, threads: int = 1) -> Dict[str, Any]:
    """Every candidate of one workload at one world size, trained in one process group. ``network``: None (the
    planners' default topology) or :data:`~benchmarks.shaped_loopback.MEASURE` (the ranks measure it before planning);
    ``rate``: the loopback's shaped rate the ranks run at, recorded with the measurement; ``threads``: each rank's
    intra-op threads."""
    outs = [items[0] for items in spawn_ranks(_rank_main, world, timeout=3000, workload=workload,
                                                     rows_cap=rows_cap, stats_batches=stats_batches,
                                                     warmup=warmup, steps=steps, network=network,
                                                     threads=threads)]
    r0 = outs[0]
    names = r0["names"]
    step = {n: slowest_rank([o["wall"][n] for o in outs]) for n in names}  # per batch, the slowest rank's
    cpu = {n: sum(statistics.median(o["cpu"][n]) for o in outs) for n in names}  # summed over the ranks
    stock = next(n for n, c in zip(names, r0["candidates"]) if STOCK in c["names"])
    plans = []
    for n, c in zip(names, r0["candidates"]):
        sent = [statistics.mean(o["sent"][n]) for o in outs]
        plans.append(dict(c, label=n, median_step_ms=statistics.median(step[n]) * 1e3,
                          paired_step_ci=median_ci([a / b for a, b in zip(step[n], step[stock])]),
                          cpu_ms_sum=cpu[n] * 1e3, cpu_vs_stock=cpu[n] / cpu[stock],
                          mean_bytes=sum(sent) / world, busiest_bytes=max(sent)))
    return {"workload": workload, "world": world, "batch": WORKLOADS[workload]["batch"], "steps": steps,
            "warmup": warmup, "rows_cap": rows_cap, "allocator": r0["allocator"], "returned": r0["returned"],
            "network": network_record(rate, r0["network"], world), "threads": threads,
            "torch_threads": r0["torch_threads"], "plans": plans, "verdicts": verdicts(plans, step)}


def short_name(names: List[str]) -> str:
    """A candidate's name as the terminal lines give it (``stock``, ``mixed``, ``all-hybrid``)."""
    return "/".join(dict.fromkeys(SHORT.get(n, n) for n in names))


def verdicts(plans: List[Dict[str, Any]], step: Dict[str, List[float]]) -> Dict[str, Dict[str, Any]]:
    """Per pricing: the candidate its planner returned and the fastest of those it weighed (the lowest median
    step), each by label and that pricing's names, their median steps, ``returned_vs_fastest`` (the returned
    plan's median step over the fastest one's; 1.0 where it is the fastest), the paired per-step ratio of the two
    with its 95% interval (``step``: per candidate label, the slowest rank's step per batch), and the verdict:
    ``within_5pct`` when that ratio is at most :data:`WITHIN`."""
    out = {}
    for pricing in HYBRID_MODELS:
        weighed = [p for p in plans if pricing in p["priced"]]
        ret = next(p for p in weighed if p["priced"][pricing]["chosen"])
        fast = min(weighed, key=lambda p: p["median_step_ms"])
        ratio = ret["median_step_ms"] / fast["median_step_ms"]
        within = ratio <= WITHIN
        verdict = (f"within {WITHIN - 1:.0%} (the fastest)" if ret is fast
                   else f"within {WITHIN - 1:.0%}" if within else f"NOT within {WITHIN - 1:.0%}")
        out[pricing] = {"returned": ret["label"], "returned_names": ret["priced"][pricing]["names"],
                        "returned_step_ms": ret["median_step_ms"], "fastest": fast["label"],
                        "fastest_names": fast["priced"][pricing]["names"], "fastest_step_ms": fast["median_step_ms"],
                        "returned_vs_fastest": ratio,
                        "paired_vs_fastest_ci": median_ci([a / b for a, b in zip(step[ret["label"]],
                                                                                 step[fast["label"]])]),
                        "within_5pct": within, "verdict": verdict, "candidates": len(weighed)}
    return out


VERDICT_LEGEND = ("Per workload and pricing: the candidate its planner returned and the fastest of those it weighed "
                  "(lowest median step); returned vs fastest: the returned plan's median step over the fastest "
                  "one's, and the same two paired per step (median [95% CI]); the verdict: within "
                  f"{WITHIN - 1:.0%} of the fastest or not.")


def verdict_text(v: Dict[str, Any]) -> str:
    """A pricing's verdict as the terminal says it: ``returned mixed, 1.03x the fastest (all-hybrid): within 5%``
    (no name in brackets where the returned plan is the fastest)."""
    fastest = "" if v["returned"] == v["fastest"] else f" ({short_name(v['fastest_names'])})"
    return (f"returned {short_name(v['returned_names'])}, {v['returned_vs_fastest']:.2f}x the fastest{fastest}: "
            f"{v['verdict']}")


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    """The legend, the candidates' table (a network column where any result ran on a shaped or measured network)
    and the allocator and threads line last (``docs_figures`` takes the table as ``[2:-2]``); :func:`sections`
    follow it in the report."""
    pricings = list(HYBRID_MODELS)
    net = networked(results)
    col, rule = ("| network ", "|---") if net else ("", "")
    cell = (lambda r: f"| {r['network']['rate']} ") if net else (lambda r: "")  # noqa: E731
    lines = [LEGEND, "",
             col + "| workload | W | candidate | its types | model cost: CPU-priced / network-priced "
             "| median step, ms | per-step ratio to stock [95% CI] | CPU, ms (vs stock) | MB / rank: mean / busiest |",
             rule + "|---|---:|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        for p in r["plans"]:
            cost = " / ".join("-" if m not in p["priced"] else
                              f"{p['priced'][m]['cost_ms']:.2f}" + ("*" if p["priced"][m]["chosen"] else "")
                              for m in pricings)
            lines.append(f"{cell(r)}| {r['workload']} | {r['world']} | {'; '.join(p['names'])} | "
                         f"{types_text(p['types'])} | {cost} | {p['median_step_ms']:.1f} | "
                         f"{ci_text(p['paired_step_ci'])} | {p['cpu_ms_sum']:.1f} ({p['cpu_vs_stock']:.2f}x) | "
                         f"{p['mean_bytes'] / 1e6:.2f} / {p['busiest_bytes'] / 1e6:.2f} |")
    lines += ["", f"Allocator: {malloc.described(results)}. Intra-op threads: {threads_text(results)}."]
    return lines


def sections(results: List[Dict[str, Any]]) -> List[str]:
    """What the report adds after :func:`markdown`: per workload and pricing, the returned plan against the
    fastest candidate (results from before the verdicts have none) and, on a shaped or measured network, the
    network each result ran on (``shaped_loopback.network_table``)."""
    net = networked(results)
    col, rule = ("| network ", "|---") if net else ("", "")
    cell = (lambda r: f"| {r['network']['rate']} ") if net else (lambda r: "")  # noqa: E731
    lines: List[str] = []
    judged = [r for r in results if r.get("verdicts")]
    if judged:
        lines += ["## Returned vs fastest", "", VERDICT_LEGEND, "",
                  col + "| workload | W | planner | returned | its median step, ms | fastest candidate | its median "
                  "step, ms | returned vs fastest | paired per step [95% CI] | verdict |",
                  rule + "|---|---:|---|---|---:|---|---:|---:|---:|---|"]
        for r in judged:
            for m, v in r["verdicts"].items():
                lines.append(f"{cell(r)}| {r['workload']} | {r['world']} | {m} | {'; '.join(v['returned_names'])} "
                             f"| {v['returned_step_ms']:.1f} | {'; '.join(v['fastest_names'])} | "
                             f"{v['fastest_step_ms']:.1f} | {v['returned_vs_fastest']:.2f}x | "
                             f"{ci_text(v['paired_vs_fastest_ci'])} | {v['verdict']} |")
    if net:
        lines += ([""] if lines else []) + network_table(results)
    return lines


def summary(results: List[Dict[str, Any]]) -> List[str]:
    """The terminal's last lines: per result each pricing's :func:`verdict_text` (and the network it ran on), then
    per rate how many of its (workload, pricing) pairs returned a plan within :data:`WITHIN` of the fastest."""
    lines, rates = [], {}
    for r in results:
        rate = r.get("network", {}).get("rate", UNSHAPED)
        for m, v in r.get("verdicts", {}).items():
            lines.append(f"{r['workload']} W={r['world']} {m}{network_tag(results, r)}: {verdict_text(v)}")
            rates.setdefault(rate, []).append((r, m, v))
    for rate, judged in rates.items():
        within = sum(v["within_5pct"] for _, _, v in judged)
        r, m, v = max(judged, key=lambda j: j[2]["returned_vs_fastest"])
        nets = [x["network"]["measured"] for x, _, _ in judged if x.get("network", {}).get("measured")]
        measured = f" (measured {gbit(nets[0]['aggregate_gbit_s'])} Gbit/s all ranks)" if nets else ""
        lines.append(f"{rate}{measured}: the returned plan within {WITHIN - 1:.0%} of the fastest candidate in "
                     f"{within} of {len(judged)} (workload, pricing); the worst {r['workload']} W={r['world']} {m} "
                     f"{v['returned_vs_fastest']:.2f}x")
    return lines


def write_json(path: str, results: List[Dict[str, Any]]) -> None:
    """The results file: every result (of every rate), a list as before ``--network`` (``docs_figures`` reads it);
    each result records its network and threads."""
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main(argv=None) -> List[Dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)  # a shaped rate's process gets the same arguments
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["onehot", "multihot", "uniform"], choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--stats-batches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="out/candidates")
    shaped_loopback.add_arguments(ap)
    add_threads_argument(ap)
    a = ap.parse_args(argv)
    for name, value, low in (("world", a.world, 2), ("rows-cap", a.rows_cap, 1), ("stats-batches", a.stats_batches, 1),
                             ("warmup", a.warmup, 0), ("steps", a.steps, 1), ("threads", a.threads, 0)):
        if value < low:
            ap.error(f"--{name} must be >= {low}, got {value}")
    # before any rank starts: the rates, the tools, the namespace, tc's own reading
    rates, inside, measure = shaped_loopback.rates_to_run(ap, a.network, a.measure_network)
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    out = shaped_loopback.out_dir(a.out, inside)
    os.makedirs(out, exist_ok=True)

    def run_here(rate: str) -> Iterator[Dict[str, Any]]:
        for w in a.workloads:
            t = time.time()
            r = run_one(w, a.world, a.rows_cap, a.stats_batches, a.warmup, a.steps, MEASURE if measure else None,
                        rate, a.threads)
            for m, v in r["verdicts"].items():
                logger.info("%s%s W=%d %s: %s (%.0f s)", "" if rate == UNSHAPED else rate + " ", w, a.world, m,
                            verdict_text(v), time.time() - t)
            yield r

    results = shaped_loopback.run_rates(rates, inside, "benchmarks.candidates", argv, a.out, "candidates.json",
                                        run_here, lambda rs: write_json(os.path.join(out, "candidates.json"), rs))
    title = f"# Every candidate plan, trained (intra-op threads: {threads_text(results)})"
    more = sections(results)
    text = "\n".join([title, ""] + markdown(results) + ([""] + more if more else [])) + "\n"
    with open(os.path.join(out, "candidates.md"), "w") as f:
        f.write(text)
    if inside is None:  # a shaped rate's process leaves the report to the run that started it
        print(text)
        for line in summary(results):
            logger.info("%s", line)
    return results


if __name__ == "__main__":
    main()
