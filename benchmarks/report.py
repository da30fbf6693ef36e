"""Turns raw per-rank numbers into results: summary per configuration, markdown, plots.

Definitions used in every output:
- bytes: OS-level bytes sent per rank per step (mean over timed steps, then over ranks);
  ``expected_bytes``: the cost model's figure for the same plan (estimate.py);
- step time: per step the slowest rank's time; median, min and max over the timed steps;
- memory: per rank, RSS growth while building the model + peak RSS growth within one step
  (VmHWM reset via /proc/self/clear_refs); the max over ranks is reported.
"""

import json
import os
import statistics
from collections import Counter
from typing import Any, Dict, List

from benchmarks.config import PLANNER_TYPES, STOCK_TYPES, Workload
from benchmarks.estimate import expected_for
from benchmarks.malloc import UNRECORDED, busiest_median, faults_text

MB = 1e6


def write_results(out: str, name: str, payload: Any, lines: List[str]) -> str:
    """Writes ``payload`` to ``out/name.json`` and the markdown ``lines`` to ``out/name.md``;
    returns that markdown (what a benchmark's ``main`` prints)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(payload, f, indent=1)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(text)
    return text


def summarize(w: Workload, ranks: List[Dict]) -> Dict:
    """One configuration's result from the raw results of all its ranks."""
    r0 = ranks[0]
    out = {}
    for kind in w.types:
        per_rank = [statistics.fmean(r["sent_bytes"][kind]) for r in ranks]
        step_times = [max(ts) for ts in zip(*(r["times_s"][kind] for r in ranks))]
        peaks = [r["build_rss_bytes"][kind] + (r["step_peak_rss_bytes"][kind] or 0) for r in ranks]
        out[kind] = {
            "bytes_per_rank_per_step": statistics.fmean(per_rank),
            "bytes_per_rank_per_step_max_rank": max(per_rank),
            "expected_bytes_per_rank_per_step": expected_for(
                r0, kind, w.dim, w.batch_per_rank, w.world, gloo=w.device == "cpu"),
            "step_time_s": {"median": statistics.median(step_times), "min": min(step_times),
                            "max": max(step_times), "n": len(step_times)},
            # per step the rank with the most minor page faults (benchmarks/malloc.py), median over steps
            "page_faults_per_step": busiest_median([r["page_faults"][kind] for r in ranks]),
            "peak_mem_bytes_per_rank": max(peaks),
            "build_rss_bytes_per_rank": max(r["build_rss_bytes"][kind] for r in ranks),
            "step_peak_rss_bytes_per_rank": max((r["step_peak_rss_bytes"][kind] or 0) for r in ranks),
            "planned_types": dict(Counter(t for t, _ in r0["table_types"][kind].values())),
        }
    lookups = sum(r0["hotness"])  # lookups per sample, one feature per table
    cold = sum(c * h for c, h in zip(r0["cold_fraction"].values(), r0["hotness"])) / lookups
    return {
        "workload": w.as_dict(),
        "hot_set": {
            "rule": f"the {w.hot_rows} most frequent rows across all tables, counted by FrequencyStats "
                    f"over {w.stats_batches} global batches drawn before the measured ones",
            "hot_rows_total": sum(r0["hot_rows_per_table"].values()),
            "cold_fraction_of_lookups": cold,
        },
        "ru_maxrss_bytes_per_rank": max(r["ru_maxrss_bytes"] for r in ranks),
        "allocator": r0["allocator"],
        "results": out,
        "ratios": ratios(out),
    }


def ratios(res: Dict) -> Dict:
    """Hybrid vs table_wise bytes, and hybrid median time vs the fastest stock type measured;
    for each hybrid planner's plan measured, the same against the stock planner's plan too
    (``planners``)."""
    if "frequency_hybrid" not in res:
        return {}
    h = res["frequency_hybrid"]
    out: Dict = {}
    if "table_wise" in res:
        out["bytes_hybrid_over_table_wise"] = (
            h["bytes_per_rank_per_step"] / res["table_wise"]["bytes_per_rank_per_step"]
        )
        out["expected_bytes_hybrid_over_table_wise"] = (
            h["expected_bytes_per_rank_per_step"] / res["table_wise"]["expected_bytes_per_rank_per_step"])
    stock = {k: res[k]["step_time_s"]["median"] for k in STOCK_TYPES if k in res}
    if stock:
        fastest = min(stock, key=stock.get)
        out["fastest_stock_type"] = fastest
        out["time_hybrid_over_fastest_stock"] = h["step_time_s"]["median"] / stock[fastest]
        planners = {k: _planner_ratios(res[k], res, stock[fastest]) for k in PLANNER_TYPES if k in res}
        if planners:
            out["planners"] = planners
    return out


def _planner_ratios(p: Dict, res: Dict, fastest_stock_s: float) -> Dict:
    """A hybrid planner's plan against table_wise and the stock planner (bytes: mean and busiest
    rank) and against the fastest stock plan (median step)."""
    out = {"time_over_fastest_stock": p["step_time_s"]["median"] / fastest_stock_s}
    for ref in ("table_wise", "planner"):
        if ref in res:
            r = res[ref]
            out[f"bytes_over_{ref}"] = p["bytes_per_rank_per_step"] / r["bytes_per_rank_per_step"]
            out[f"busiest_bytes_over_{ref}"] = (p["bytes_per_rank_per_step_max_rank"]
                                                / r["bytes_per_rank_per_step_max_rank"])
            out[f"time_over_{ref}"] = p["step_time_s"]["median"] / r["step_time_s"]["median"]
    return out


def markdown(results: List[Dict], title: str) -> str:
    lines = [f"# {title}", "",
             "Bytes: OS-level bytes sent per rank per step (wchar), mean over steps and ranks; "
             "model = cost-model estimate for the same plan. Time: slowest rank per step, median "
             "[min-max] over interleaved timed steps; page faults: minor page faults of a step, the rank with "
             "the most, median over steps (`benchmarks/malloc.py`). Memory: max over ranks of RSS growth at build "
             "+ peak RSS growth in one step.", ""]
    for r in results:
        w, hs = r["workload"], r["hot_set"]
        lines += [f"## {w['name']}", "",
                  f"W={w['world']} {w['device']}, {w['model']}, "
                  f"{'multi-hot (DLRMv2)' if w['multi_hot'] else 'one-hot'}, "
                  f"{'uniform ids' if w['alpha'] == 0 else 'Zipf ' + format(w['alpha'], 'g')}, 26 tables cap "
                  f"{w['rows_cap']:,} rows, dim {w['dim']}, B={w['batch_per_rank']}/rank, "
                  f"{w['steps']} timed steps. Hot set: {hs['hot_rows_total']} rows, "
                  f"cold fraction of lookups {hs['cold_fraction_of_lookups']:.3f}. "
                  f"Allocator: {r.get('allocator', UNRECORDED)}.", "",
                  "| type | MB sent/rank/step | model MB | model/measured | step ms median [min-max] "
                  "| page faults | peak MB/rank | plan |",
                  "|---|---:|---:|---:|---|---:|---:|---|"]
        for kind, x in r["results"].items():
            t = x["step_time_s"]
            plan = ", ".join(f"{k}x{v}" for k, v in x["planned_types"].items())
            lines.append(
                f"| {kind} | {x['bytes_per_rank_per_step'] / MB:.3f} "
                f"| {x['expected_bytes_per_rank_per_step'] / MB:.3f} "
                f"| {x['expected_bytes_per_rank_per_step'] / max(1.0, x['bytes_per_rank_per_step']):.3f} "
                f"| {t['median'] * 1e3:.1f} [{t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}] "
                f"| {faults_text(x.get('page_faults_per_step'))} "
                f"| {x['peak_mem_bytes_per_rank'] / MB:.1f} | {plan} |")
        rt = r["ratios"]
        if "bytes_hybrid_over_table_wise" in rt and "time_hybrid_over_fastest_stock" in rt:
            lines += ["", f"Hybrid / table_wise bytes: **{rt['bytes_hybrid_over_table_wise']:.3f}** "
                          f"(model {rt['expected_bytes_hybrid_over_table_wise']:.3f}); hybrid / fastest stock "
                          f"({rt['fastest_stock_type']}) median step time: "
                          f"**{rt['time_hybrid_over_fastest_stock']:.3f}**."]
        for kind, q in rt.get("planners", {}).items():
            lines += ["", f"{kind}: busiest-rank bytes / stock planner's **{q['busiest_bytes_over_planner']:.3f}**, "
                          f"median step / fastest stock ({rt['fastest_stock_type']}) "
                          f"**{q['time_over_fastest_stock']:.3f}**."]
        lines.append("")
    return "\n".join(lines)
