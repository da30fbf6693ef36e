"""The measured figures of README.md, docs/results.md and benchmarks/README.md, from the committed results.

    .venv/bin/python -m benchmarks.docs_figures            # check: names every figure that drifted (exit 1)
    .venv/bin/python -m benchmarks.docs_figures --write    # rewrite the marked tables from the results files

Nothing is measured here: every figure is read or derived from a file a benchmark script writes
(``benchmarks/results/*.json``: ``python -m benchmarks``, ``benchmarks.product``, ``benchmarks.drift``,
``benchmarks.simulate``, ``benchmarks.calibrate``, ``benchmarks.device_check``, ``benchmarks.candidates``,
``benchmarks.qcomms``; and the committed results of one-off studies whose scripts left the tree, read as they
are: ``comm_floor``, ``tbe_paths``). Tables sit between
``<!-- table: NAME ... -->`` and ``<!-- end table -->`` and ``--write`` renders them again. Figures in
prose are ``SNIPPETS``: a template filled from ``facts()`` that must stand verbatim in its doc
(whitespace folded); prose is not rewritten, so when a results file changes the check names the
sentence to reword. Finally no ratio, MB, kB, ms, % or minute figure may stand in a doc outside a
table or a snippet (``unbound_figures``). ``tests/benchmarks/test_benchmarks_docs_figures.py`` runs
the check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from benchmarks.malloc import faults_text
from benchmarks.measure import paired_text

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DOCS = {"README.md": os.path.join(REPO, "README.md"),
        "docs/results.md": os.path.join(REPO, "docs", "results.md"),
        "benchmarks/README.md": os.path.join(REPO, "benchmarks", "README.md")}
START = "<!-- table: {} (python -m benchmarks.docs_figures --write) -->"
END = "<!-- end table -->"

WORKLOADS = ("onehot", "multihot", "sorted-onehot", "sorted-multihot", "uniform")
HYBRID = ("hybrid_planner", "hybrid_planner_bytes")  # CPU-priced, network-priced
PLAN_LABELS = {"hybrid_planner": "CPU-priced", "hybrid_planner_bytes": "network-priced",
               "stock_planner": "stock planner"}


def load(name: str) -> Dict[str, Any]:
    with open(os.path.join(RESULTS, name + ".json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- formatting


def x2(v: float) -> str:
    return f"{v:.2f}x"


def span(values: Iterable[float], fmt: Callable[[float], str], sep: str = "-") -> str:
    """'lo-hi' of the formatted min and max (one value when they print alike); a unit suffix once."""
    vs = sorted(values)
    lo, hi = fmt(vs[0]), fmt(vs[-1])
    if lo == hi:
        return lo
    unit = re.sub(r"^[\d.,]+", "", hi)
    return lo[: len(lo) - len(unit)] + sep + hi if unit and lo.endswith(unit) else lo + sep + hi


NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}  # how the prose counts runs


def unique(values: Iterable[Any], what: str) -> Any:
    vs = list(dict.fromkeys(values))
    if len(vs) != 1:
        raise ValueError(f"{what}: expected one value, the results have {vs}")
    return vs[0]


def single(items: Sequence[Any], what: str) -> Any:
    if len(items) != 1:
        raise ValueError(f"{what}: expected one, the results have {len(items)}")
    return items[0]


def ceil_to(v: float, step: float) -> float:
    return math.ceil(round(v / step, 9)) * step


def types_text(types: Dict[str, int]) -> str:
    return " + ".join(f"{n} {k}" for k, n in sorted(types.items()))


def n_hybrid(types: Dict[str, int]) -> int:
    return sum(n for k, n in types.items() if k.startswith("frequency_hybrid"))


def n_layout(types: Dict[str, int], layout: str) -> int:
    return sum(n for k, n in types.items() if k == f"frequency_hybrid/{layout}-cold")


# ---------------------------------------------------------------- product benchmark


def product() -> Dict[Tuple[str, int], Dict[str, Any]]:
    """(workload, W) -> result, from product_w4.json and product_w28.json."""
    out = {}
    for name in ("product_w4", "product_w28"):
        for r in load(name)["results"]:
            out[(r["workload"], r["world"])] = r
    return out


def _total(counts: Dict[str, int], what: str) -> int:
    return counts[f"fwd_{what}"] + counts[f"bwd_{what}"]


def _est_error(r: Dict[str, Any]) -> float:
    """Largest |estimate / measured - 1| over the ranks of all three plans of one result."""
    return max(abs(e) for m in (*HYBRID, "stock_planner") for e in (r[m]["estimate_error_per_rank"] or [0.0]))


def _plan_cost_ms(lines: List[str], prefix: str) -> float:
    """The planner's priced cost of one candidate in its logged comparison: ``"*"`` the one it returned."""
    match = (lambda ln: ln.startswith("*")) if prefix == "*" else (lambda ln: ln.lstrip("* ").startswith(prefix))
    line = unique((ln for ln in lines[1:] if match(ln)), f"comparison line {prefix!r}")
    return float(re.search(r", ([\d.]+) ms;", line).group(1))


LABELS = {"onehot": "one id per feature, B={batch}", "multihot": "DLRMv2 multi-hot sizes, B={batch}",
          "sorted-onehot": "frequency-sorted ids, one-hot", "sorted-multihot": "frequency-sorted ids, multi-hot",
          "uniform": "uniform ids, one-hot"}
SHORT = {"onehot": "one-hot", "multihot": "DLRMv2 multi-hot", "sorted-onehot": "frequency-sorted one-hot",
         "sorted-multihot": "frequency-sorted multi-hot", "uniform": "uniform ids, one-hot"}


def table_readme_product() -> str:
    """README: the W=4 product run, CPU-priced / network-priced against the stock planner."""
    p = product()
    rows = ["| workload | busiest-rank bytes vs stock planner: CPU-priced / network-priced "
            "| median step vs stock: CPU-priced / network-priced | model vs measured bytes per rank |",
            "|---|---:|---:|---:|"]
    for w in WORKLOADS:
        r = p[(w, 4)]
        q = [r["ratios"][m] for m in HYBRID]
        # bold: under half the stock plan's bytes, or a step 1.3x the stock plan's or more
        b = [f"**{x2(v['busiest'])}**" if v["busiest"] < 0.5 else x2(v["busiest"]) for v in q]
        s = [f"**{x2(v['step'])}**" if v["step"] >= 1.3 else x2(v["step"]) for v in q]
        err = f"within {ceil_to(_est_error(r) * 100, 1):.0f}%"
        rows.append(f"| {LABELS[w].format(batch=r['batch'])} | {b[0]} / {b[1]} | {s[0]} / {s[1]} | {err} |")
    return "\n".join(rows)


def _product_grid(key: Optional[str], fmt: Callable[[Any], str] = x2) -> str:
    """Per workload and W, ``fmt`` of the CPU-priced / network-priced plan's ``ratios[key]`` (``key`` None:
    ``fmt`` of the whole ``ratios`` entry)."""
    p = product()
    worlds = sorted({w for _, w in p})
    rows = ["| workload | " + " | ".join(f"W={w}" for w in worlds) + " |", "|---|" + "---:|" * len(worlds)]
    for wl in WORKLOADS:
        cells = [" / ".join(fmt(q if key is None else q[key]) for q in (p[(wl, w)]["ratios"][m] for m in HYBRID))
                 for w in worlds]
        rows.append(f"| {SHORT[wl]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table_results_product_bytes() -> str:
    return _product_grid("busiest")


def table_results_product_steps() -> str:
    return _product_grid("step")


def table_results_product_paired() -> str:
    """The per-step paired ratio's median and 95% interval over the runs' pooled steps, and the range of each
    run's own median (benchmarks.product ``paired_step_ci``, ``paired_step_runs``)."""
    return _product_grid(None, paired_text)


def _w4_runs(name: str) -> Dict[str, Dict[str, Any]]:
    """A product run's W=4 results by workload."""
    return {r["workload"]: r for r in load(name)["results"] if r["world"] == 4}


def table_results_cpu_plans() -> str:
    """The CPU-priced plan's sharding types per workload and W (the network-priced one is all hybrid)."""
    p = product()
    worlds = sorted({w for _, w in p})
    rows = ["| workload | " + " | ".join(f"W={w}" for w in worlds) + " |", "|---|" + "---|" * len(worlds)]
    for wl in WORKLOADS:
        rows.append(f"| {SHORT[wl]} | " + " | ".join(types_text(p[(wl, w)]["types"]["hybrid_planner"])
                                                     for w in worlds) + " |")
    return "\n".join(rows)


def _plan_kind(types: Dict[str, int]) -> str:
    """How the docs name a plan by its types: all frequency_hybrid, stock types, or mixed."""
    n = n_hybrid(types)
    return "all frequency_hybrid" if n == sum(types.values()) else "stock types" if n == 0 else "mixed"


def table_results_step_counts(world: int = 4) -> str:
    """Collectives, host syncs and ops per step at W=``world``, per plan and kind of plan (its workloads)."""
    p = product()
    rows = ["| W | plan | collectives | host syncs | ops dispatched | page faults |", "|---:|---|---:|---:|---:|---:|"]
    for m, label in PLAN_LABELS.items():
        kinds: Dict[str, List[str]] = {}
        for wl in WORKLOADS:
            kinds.setdefault(_plan_kind(p[(wl, world)]["types"][m]), []).append(wl)
        for kind, wls in kinds.items():
            cs = [p[(wl, world)][m]["counts"] for wl in wls]
            cell = [" / ".join(span((c[f"{d}_{k}"] for c in cs), str) for d in ("fwd", "bwd"))
                    for k in ("collectives", "host_syncs", "ops")]
            cell.append(span((p[(wl, world)][m]["page_faults_per_step"] for wl in wls), faults_text))
            which = "" if len(kinds) == 1 else f": {', '.join(SHORT[wl] for wl in wls)}"
            rows.append(f"| {world} | {label} ({kind}{which}) | " + " | ".join(cell) + " |")
    return "\n".join(rows)


ALLOCATOR_RUNS = {"fixed": "product_w4", "glibc defaults": "product_w4_glibc"}


def _allocator_runs() -> Dict[str, Dict[str, Dict[str, Any]]]:
    """The W=4 product run under each allocator mode (benchmarks/malloc.py), by workload; both must have run the
    same plans."""
    runs = {mode: _w4_runs(name) for mode, name in ALLOCATOR_RUNS.items()}
    fixed, default = runs.values()
    for wl in WORKLOADS:
        if fixed[wl]["types"] != default[wl]["types"]:
            raise ValueError(f"{wl}: product_w4 and product_w4_glibc ran other plans")
    return runs


def table_results_allocator() -> str:
    """Per workload at W=4: page faults per step of each plan and the hybrid plans' paired step ratio, with glibc's
    malloc thresholds fixed (the benchmarks' default) and with its defaults (``--malloc default``)."""
    from benchmarks.measure import ci_text

    runs = _allocator_runs()
    modes = " / ".join(runs)
    rows = [f"| workload | page faults per step ({modes}): " + " | ".join(PLAN_LABELS.values())
            + f" | paired step vs stock ({modes}): CPU-priced | network-priced |", "|---|" + "---:|" * 5]
    for wl in WORKLOADS:
        faults = [" / ".join(faults_text(r[wl][m]["page_faults_per_step"]) for r in runs.values()) for m in PLAN_LABELS]
        steps = [" / ".join(ci_text(r[wl]["ratios"][m]["paired_step_ci"]) for r in runs.values()) for m in HYBRID]
        rows.append(f"| {SHORT[wl]} | " + " | ".join(faults + steps) + " |")
    return "\n".join(rows)


def _allocator_facts() -> Dict[str, str]:
    """What glibc's default malloc thresholds did to the W=4 product run (``product_w4_glibc``) against the
    committed run with them fixed (``product_w4``)."""
    from benchmarks.measure import ci_text

    fixed, default = _allocator_runs().values()
    f = {"alloc_fixed": unique((r["allocator"] for r in fixed.values()), "product_w4 allocator"),
         "alloc_default": unique((r["allocator"] for r in default.values()), "product_w4_glibc allocator")}
    if "fixed" not in f["alloc_fixed"] or "default" not in f["alloc_default"]:
        raise ValueError(f"allocators {f['alloc_fixed']!r} / {f['alloc_default']!r}: expected fixed / default")
    most = max(r[m]["page_faults_per_step"] for r in fixed.values() for m in PLAN_LABELS)
    f["alloc_fixed_faults"] = faults_text(most)
    for wl in ("onehot", "multihot"):
        f[f"alloc_{wl}_stock_faults"] = faults_text(default[wl]["stock_planner"]["page_faults_per_step"])
        f[f"alloc_{wl}_cpu_faults"] = faults_text(default[wl]["hybrid_planner"]["page_faults_per_step"])
        f[f"alloc_{wl}_default"] = ci_text(default[wl]["ratios"]["hybrid_planner"]["paired_step_ci"])
        f[f"alloc_{wl}_fixed"] = ci_text(fixed[wl]["ratios"]["hybrid_planner"]["paired_step_ci"])
    return f


# ---------------------------------------------------------------- headline run (python -m benchmarks --headline)


def _mb(v: float) -> str:
    """Two decimals below 20 MB, three significant figures above."""
    return f"{v:.2f}" if v < 20 else f"{v:.3g}"


def _ratio(v: float) -> str:
    return f"{v:.2f}x" if v < 2 else (f"{v:.1f}x" if v < 10 else f"{v:.0f}x")


def _planned(types: Dict[str, int]) -> str:
    """A plan's table counts per type, as the docs name them ("all table_wise", "12 data_parallel + 14 ...")."""
    return f"all {next(iter(types))}" if len(types) == 1 else types_text(types)


def _headline_table(with_time: bool) -> str:
    c = single(load("headline")["configurations"], "headline configurations")
    res = c["results"]
    tw = res["table_wise"]["bytes_per_rank_per_step"]
    names = {"row_wise": "row_wise (by hand)", "frequency_hybrid": "frequency_hybrid (by hand, all tables)",
             "planner": f"stock planner ({_planned(res['planner']['planned_types'])})"}
    for kind, pricing in (("hybrid_planner", "CPU-priced"), ("hybrid_planner_bytes", "network-priced")):
        if kind in res:
            names[kind] = f"**hybrid planner**, {pricing} ({_planned(res[kind]['planned_types'])})"
    head = "| plan | MB sent / rank / step | vs table_wise |" + (" median step |" if with_time else "")
    rows = [head, "|---|---:|---:|" + ("---:|" if with_time else "")]
    for t in c["workload"]["types"]:
        if t == "planner" and not with_time:
            continue
        r = res[t]
        mb = _mb(r["bytes_per_rank_per_step"] / 1e6)
        if t == "frequency_hybrid" or t.startswith("hybrid_planner"):
            mb += f" (model {_mb(r['expected_bytes_per_rank_per_step'] / 1e6)})"
        ratio = _ratio(r["bytes_per_rank_per_step"] / tw)
        if t == "frequency_hybrid" and with_time:
            ratio = f"**{ratio}**"
        row = f"| {names.get(t, t)} | {mb} | {ratio} |"
        if with_time:
            row += f" {r['step_time_s']['median'] * 1e3:.0f} ms |"
        rows.append(row)
    return "\n".join(rows)


def table_readme_headline() -> str:
    return _headline_table(with_time=True)


def table_results_headline() -> str:
    return _headline_table(with_time=False)


# ---------------------------------------------------------------- projection (python -m benchmarks.simulate)


def table_results_projection(worlds: Sequence[int] = (8, 64, 1024)) -> str:
    one, multi = load("projected"), load("projected_multihot")
    rows = ["| W | one-hot: hybrid / table_wise | multi-hot, row-wise cold / table_wise "
            "| multi-hot, table-wise cold / table_wise |", "|---:|---:|---:|---:|"]
    for w in worlds:
        i, j = one["worlds"].index(w), multi["worlds"].index(w)
        b, m = one["bytes"], multi["bytes"]
        rows.append(f"| {w} | {x2(b['frequency_hybrid_best_H'][i] / b['table_wise'][i])} "
                    f"| {x2(m['frequency_hybrid_row_wise_cold'][j] / m['table_wise'][j])} "
                    f"| {x2(m['frequency_hybrid_table_wise_cold'][j] / m['table_wise'][j])} |")
    return "\n".join(rows)


def _projection_ratios(name: str, column: str) -> List[float]:
    d = load(name)
    return [h / t for h, t in zip(d["bytes"][column], d["bytes"]["table_wise"])]


# ---------------------------------------------------------------- drift (python -m benchmarks.drift)


def table_bench_drift() -> str:
    d = load("drift")
    stock = d["runs"]["stock"]["mean_bytes"]
    stock_label = "stock (" + " + ".join(f"{n} {k}" for k, n in d["stock_types"].items()) + ")"
    rows = ["| plan | MB / rank / step (mean) | last point | last point / ideal | max over points / ideal "
            "| vs stock |", "|---|---:|---:|---:|---:|---:|"]
    for plan in ("static", "refreshed", "ideal", "stock"):
        r = d["runs"][plan]
        last = r["last_point_bytes"] / d["runs"]["ideal"]["last_point_bytes"]
        top = max(d["ratio_to_ideal"][plan])
        cells = [x2(last), x2(top)]
        if plan == "refreshed":
            cells = [f"**{c}**" for c in cells]
        rows.append(f"| {stock_label if plan == 'stock' else plan} | {r['mean_bytes'] / 1e6:.3f} "
                    f"| {r['last_point_bytes'] / 1e6:.3f} | {cells[0]} | {cells[1]} | {x2(r['mean_bytes'] / stock)} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- quantized comms (python -m benchmarks.qcomms)


def table_results_qcomms() -> str:
    from benchmarks.qcomms import markdown

    return "\n".join(markdown(load("qcomms_w4")["results"]))


# ---------------------------------------------------------------- our dist code on a GPU (benchmarks.device_check)


def table_results_device_check() -> str:
    from benchmarks.device_check import markdown

    return "\n".join(markdown(load("device_check_h200")).splitlines()[4:])  # the table, without its preamble


# ---------------------------------------------------------------- every candidate plan, trained (benchmarks.candidates)


def table_results_candidates() -> str:
    from benchmarks.candidates import markdown

    return "\n".join(markdown(load("candidates"))[2:-2])  # the table, without its preamble and allocator line


def _candidates_facts() -> Dict[str, str]:
    """Per pricing, on how many workloads the plan the planner returned was the fastest candidate it weighed;
    for the CPU-priced planner, whether its model orders its candidates as their measured process CPU and
    median step do, and whether its mixed candidate is slower and priced dearer than the best pure one
    (benchmarks.candidates)."""
    from benchmarks.candidates import MIXED

    res = load("candidates")
    n = len(res)
    agree_cpu = agree_step = mixed_slower = 0
    fastest = {"hybrid_planner": 0, "hybrid_planner_bytes": 0}
    sizes = set()
    for r in res:
        weighed = {m: [p for p in r["plans"] if m in p["priced"]] for m in fastest}
        for m, priced in weighed.items():
            chosen = single([p for p in priced if p["priced"][m]["chosen"]], f"candidates {r['workload']} {m} choice")
            fastest[m] += chosen["median_step_ms"] == min(p["median_step_ms"] for p in priced)
        priced = weighed["hybrid_planner"]
        sizes.add(len(priced))
        cost = [p["priced"]["hybrid_planner"]["cost_ms"] for p in priced]
        by_model = sorted(range(len(priced)), key=cost.__getitem__)
        agree_cpu += by_model == sorted(range(len(priced)), key=lambda i: priced[i]["cpu_ms_sum"])
        agree_step += by_model == sorted(range(len(priced)), key=lambda i: priced[i]["median_step_ms"])
        # the mixed candidate (when it is no other candidate too) against the best pure one
        mixed = [p for p in priced if set(p["priced"]["hybrid_planner"]["names"]) == {MIXED}]
        pure = [p for p in priced if p not in mixed]
        mixed_slower += bool(mixed) and bool(pure) and all(
            m["median_step_ms"] > min(p["median_step_ms"] for p in pure)
            and m["priced"]["hybrid_planner"]["cost_ms"] > min(p["priced"]["hybrid_planner"]["cost_ms"] for p in pure)
            for m in mixed)
    return {"cand_world": str(unique((r["world"] for r in res), "candidates world")),
            "cand_steps": str(unique((r["steps"] for r in res), "candidates steps")),
            "cand_workloads": ", ".join(r["workload"] for r in res),
            "cand_n": str(unique(sizes, "candidates per workload (CPU-priced)")),
            "cand_cpu_agree": f"{agree_cpu} of {n}", "cand_step_agree": f"{agree_step} of {n}",
            "cand_mixed_slower": f"{mixed_slower} of {n}",
            "cand_cpu_fastest": f"{fastest['hybrid_planner']} of {n}",
            "cand_net_fastest": f"{fastest['hybrid_planner_bytes']} of {n}"}


TABLES: Dict[str, Tuple[str, Callable[[], str]]] = {
    "readme_product": ("README.md", table_readme_product),
    "readme_headline": ("README.md", table_readme_headline),
    "results_product_bytes": ("docs/results.md", table_results_product_bytes),
    "results_product_steps": ("docs/results.md", table_results_product_steps),
    "results_product_paired": ("docs/results.md", table_results_product_paired),
    "results_step_counts": ("docs/results.md", table_results_step_counts),
    "results_allocator": ("docs/results.md", table_results_allocator),
    "results_cpu_plans": ("docs/results.md", table_results_cpu_plans),
    "results_headline": ("docs/results.md", table_results_headline),
    "results_projection": ("docs/results.md", table_results_projection),
    "results_qcomms": ("docs/results.md", table_results_qcomms),
    "results_candidates": ("docs/results.md", table_results_candidates),
    "results_device_check": ("docs/results.md", table_results_device_check),
    "bench_drift": ("benchmarks/README.md", table_bench_drift),
}


# ---------------------------------------------------------------- figures in prose


def _minutes(seconds: float) -> str:
    m = max(1, round(seconds / 60))
    return f"{m} minute" + ("s" if m > 1 else "")


ONEHOTS, MULTIHOTS = ("onehot", "sorted-onehot", "uniform"), ("multihot", "sorted-multihot")
SKEWED_ONEHOTS = ("onehot", "sorted-onehot")


def facts() -> Dict[str, str]:
    """Every figure the docs quote in prose, formatted as they quote it, by name."""
    p = product()
    worlds = sorted({w for _, w in p})
    w4 = {wl: p[(wl, 4)] for wl in WORKLOADS}
    f: Dict[str, str] = {}
    f.update(_product_run_facts(p))
    f.update(_cpu_plan_facts(p, worlds, w4))
    f.update(_net_plan_facts(p, worlds, w4))
    f.update(_step_count_facts(w4))
    f.update(_calibration_facts())
    f.update(_projection_facts())
    f.update(_drift_facts())
    f.update(_headline_and_sweep_facts())
    f.update(_device_check_facts())
    f["tbe_extra_share"] = f"{load('tbe_paths')['extra_share']:.2f}"
    f.update(_candidates_facts())
    f.update(_allocator_facts())
    f.update(_comm_floor_facts())
    return f


def _comm_floor_facts() -> Dict[str, str]:
    """Each plan's collectives replayed alone (comm_floor.json, a one-off study): their share of the stock step,
    the hybrid's collectives' time and bytes against stock's, the bytes-only bound and the hybrid's compute excess."""
    from benchmarks.measure import ci_text as ci

    res = {r["workload"]: r for r in load("comm_floor")}
    if set(res) != {"onehot", "multihot"}:
        raise ValueError(f"comm_floor.json covers {sorted(res)}; the docs quote onehot and multihot: reword them")
    small = [t for r in res.values() for p in r["plans"].values()
             for t, b in zip(p["each_s"], p["each_buffer_bytes"]) if b < 300_000]
    f = {"cf_world": str(unique((r["world"] for r in res.values()), "comm_floor world")),
         "cf_small_ms": span((t * 1e3 for t in small), lambda v: f"{v:.1f} ms"),
         "cf_runs": str(unique((r.get("repeats", 1) for r in res.values()), "comm_floor repeats")),
         "cf_steps": str(unique((r["steps"] for r in res.values()), "comm_floor steps"))}
    for wl, key in (("onehot", "oh"), ("multihot", "mh")):
        plans = res[wl]["plans"]
        stock = plans["stock_planner"]
        f[f"cf_{key}_share"] = f"{stock['collectives_share']:.0%}"
        f[f"cf_{key}_stock_n"] = str(len(stock["collectives"]))
        # the plan quoted: one-hot's CPU-priced (hybrid), multi-hot's network-priced (the CPU-priced is TorchRec's)
        p = plans["hybrid_planner" if key == "oh" else "hybrid_planner_bytes"]
        f[f"cf_{key}_n"] = str(len(p["collectives"]))
        f[f"cf_{key}_time"] = f"{p['median_collectives_s'] / stock['median_collectives_s']:.2f}x"
        # the steps' bytes, as the product tables quote them (the replay's were within 10% of them)
        f[f"cf_{key}_bytes"] = f"{p['step_bytes_busiest'] / stock['step_bytes_busiest']:.2f}x"
        f[f"cf_{key}_bound"] = ci(p["bytes_only_bound"])
        f[f"cf_{key}_step"] = ci(p["step_ratio"])
        f[f"cf_{key}_excess"] = f"{p['compute_excess_s'] * 1e3:.1f} ms"
    return f


def _device_check_facts() -> Dict[str, str]:
    """The GPU check's W=1 (NCCL) rows: the kernels' own time against the step, and the launches."""
    result = load("device_check_h200")
    rows = [r for r in result["rows"] if r["world"] == 1]
    kernels = [r["launches_per_step"]["kernels"] for r in rows]
    per_launch = [1000 * (r["step_ms"] - r["launches_per_step"]["gpu_kernel_ms"]) / r["launches_per_step"]["kernels"]
                  for r in rows]
    return {"dc_kernel_ms": span((r["launches_per_step"]["gpu_kernel_ms"] for r in rows), lambda v: f"{v:.1f}"),
            "dc_step_ms": span((r["step_ms"] for r in rows), lambda v: f"{v:.1f}"),
            "dc_launches": str(unique(kernels, "GPU check launches")),
            "dc_per_launch_us": str(round(statistics.median(per_launch))),
            "dc_gpu": result["gpu"].removeprefix("NVIDIA ").split()[0]}


def _product_run_facts(p: Dict[Tuple[str, int], Dict[str, Any]]) -> Dict[str, str]:
    """What the product runs ran (command lines, setup, batch sizes): the docs quote them to reproduce the runs."""
    f: Dict[str, str] = {}
    a4, a28 = load("product_w4")["args"], load("product_w28")["args"]
    repeats = unique((a4.get("repeats", 1), a28.get("repeats", 1)), "product repeats at W=4 and at W=2, 8")
    flag = f" --repeats {repeats}" if repeats > 1 else ""
    f["w4_cmd"] = f"--world {' '.join(map(str, a4['world']))} --steps {a4['steps']}{flag}"
    f["w28_cmd"] = f"--world {' '.join(map(str, a28['world']))} --steps {a28['steps']}{flag}"
    f["w4_steps"] = str(a4["steps"])
    f["product_steps"] = str(unique((a4["steps"], a28["steps"]), "product steps at W=4 and at W=2, 8"))
    f["product_repeats"] = str(repeats)
    f["product_repeats_words"] = NUMBER_WORDS.get(repeats, str(repeats))
    f["product_pooled_steps"] = str(repeats * int(f["product_steps"]))
    f["w4_setup"] = (f"{unique(a4['world'], 'product_w4 world')} gloo ranks on 2 CPU cores, the 26 Criteo-Kaggle "
                     f"tables capped at {a4['rows_cap'] // 1000}k rows")
    f["stats_batches"] = str(unique((a4["stats_batches"], a28["stats_batches"]), "stats batches"))
    f["batch_onehot"] = str(unique((r["batch"] for (wl, _), r in p.items() if wl in ONEHOTS), "one-hot batch"))
    f["batch_multihot"] = str(unique((r["batch"] for (wl, _), r in p.items() if wl in MULTIHOTS), "multi-hot batch"))
    return f


def _cpu_plan_facts(p: Dict[Tuple[str, int], Dict[str, Any]], worlds: List[int],
                    w4: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    """The CPU-priced plan (hybrid_planner): hybrid with one id per feature, stock types otherwise (the docs say
    so: other results raise), its byte and step ratios, relabelling noise and cost."""
    f: Dict[str, str] = {}
    kind = {k: _plan_kind(r["types"]["hybrid_planner"]) for k, r in p.items()}
    hybrid = {k for k, v in kind.items() if v == "all frequency_hybrid"}
    stock = {k for k, v in kind.items() if v == "stock types"}
    if hybrid != {k for k in p if k[0] in SKEWED_ONEHOTS} or stock != set(p) - hybrid:
        raise ValueError(f"CPU-priced plans: all hybrid for {sorted(hybrid)}, stock for {sorted(stock)}; the docs "
                         f"say all hybrid for {SKEWED_ONEHOTS} at every W and stock types otherwise: reword them")
    w4_hybrid = [wl for wl in WORKLOADS if (wl, 4) in hybrid]
    w4_stock = [wl for wl in WORKLOADS if (wl, 4) in stock]
    f["w4_cpu_hybrid_bytes"] = span((w4[wl]["ratios"]["hybrid_planner"]["busiest"] for wl in w4_hybrid), x2)
    f["w4_cpu_hybrid_step"] = span((w4[wl]["ratios"]["hybrid_planner"]["step"] for wl in w4_hybrid), x2)
    f["w4_cpu_types_stock"] = unique((types_text(w4[wl]["types"]["hybrid_planner"]) for wl in w4_stock),
                                     "CPU types W=4 where not hybrid")
    f["w4_cpu_stock_step"] = span((w4[wl]["ratios"]["hybrid_planner"]["step"] for wl in w4_stock), x2)
    f["cpu_hybrid_bytes"] = span((p[k]["ratios"]["hybrid_planner"]["busiest"] for k in hybrid), x2)
    f["cpu_hybrid_step"] = span((p[k]["ratios"]["hybrid_planner"]["step"] for k in hybrid), x2)
    f["cpu_stock_bytes"] = span((p[k]["ratios"]["hybrid_planner"]["busiest"] for k in stock), x2)
    f["cpu_stock_step"] = span((p[k]["ratios"]["hybrid_planner"]["step"] for k in stock), x2)
    f.update(_relabel_facts(p, worlds))
    # the sentence is about the workloads where the CPU-priced plan is hybrid (elsewhere it is the stock plan: 1.00x)
    cost = [_plan_cost_ms(w4[wl]["comparison"]["hybrid_planner"], "*")
            / _plan_cost_ms(w4[wl]["comparison"]["hybrid_planner"], "stock") for wl in w4_hybrid]
    f["w4_cpu_cost"] = span(cost, x2)
    return f


def _relabel_facts(p: Dict[Tuple[str, int], Dict[str, Any]], worlds: List[int]) -> Dict[str, str]:
    """The CPU-priced step ratios of multi-hot vs frequency-sorted multi-hot where both plans are the same stock
    types (no hot set, no row blocks): the same plans on the same batches up to a relabelling of ids, so their
    difference is the timing noise the docs quote."""
    relabel = []
    for w in worlds:
        a, b = p[("multihot", w)], p[("sorted-multihot", w)]
        for m in ("hybrid_planner", "stock_planner"):
            if a["types"][m] != b["types"][m]:
                raise ValueError(f"W={w} {m}: multi-hot and sorted multi-hot plans differ; reword the noise note")
            if n_hybrid(a["types"][m]):  # hot sets and row blocks follow the ids: not a mere relabelling
                raise ValueError(f"W={w} {m}: the multi-hot plans are hybrid; reword the noise note")
        if x2(a["ratios"]["hybrid_planner"]["busiest"]) != x2(b["ratios"]["hybrid_planner"]["busiest"]):
            raise ValueError(f"W={w}: multi-hot and sorted multi-hot byte ratios differ; reword the noise note")
        relabel.append((w, x2(a["ratios"]["hybrid_planner"]["step"]), x2(b["ratios"]["hybrid_planner"]["step"])))
    return {"w4_relabel": " and ".join(next(r[1:] for r in relabel if r[0] == 4)),
            "relabel": ", ".join(f"{a} / {b} at W={w}" for w, a, b in relabel)}


def _net_plan_facts(p: Dict[Tuple[str, int], Dict[str, Any]], worlds: List[int],
                    w4: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    """The network-priced plan (hybrid_planner_bytes): hybrid table counts, byte / step ratios, balance, model error."""
    f: Dict[str, str] = {}
    net = {k: r["types"]["hybrid_planner_bytes"] for k, r in p.items()}
    f["w4_net_tables"] = span((n_hybrid(net[(wl, 4)]) for wl in WORKLOADS), str)
    f["net_tables"] = span((n_hybrid(t) for t in net.values()), str)
    f["net_tw_cold_multihot"] = span((n_layout(net[(wl, w)], "table_wise") for wl in MULTIHOTS for w in worlds), str)
    f["w4_net_onehot"] = x2(w4["onehot"]["ratios"]["hybrid_planner_bytes"]["busiest"])
    f["w4_net_multihot"] = x2(w4["multihot"]["ratios"]["hybrid_planner_bytes"]["busiest"])
    sorted_balance = max(w4[wl]["ratios"]["hybrid_planner_bytes"]["busiest_over_mean"]
                         for wl in ("sorted-onehot", "sorted-multihot"))
    f["w4_net_sorted_balance"] = f"{sorted_balance:.2f}"
    f["w4_net_slow"] = span((w4[wl]["ratios"]["hybrid_planner_bytes"]["step"] for wl in (*MULTIHOTS, "uniform")),
                            lambda v: f"{v:.1f}x")
    f["net_slow_w48"] = span((p[(wl, w)]["ratios"]["hybrid_planner_bytes"]["step"] for wl in (*MULTIHOTS, "uniform")
                              for w in worlds if w > 2), lambda v: f"{v:.1f}x")
    bal = {k: r["ratios"]["hybrid_planner_bytes"]["busiest_over_mean"] for k, r in p.items()}
    f["net_balance_small"] = span((v for (_, w), v in bal.items() if w <= 4), lambda v: f"{v:.2f}")
    (wl8, w8), top8 = max(((k, v) for k, v in bal.items() if k[1] > 4), key=lambda kv: kv[1])
    f["net_balance_big"] = f"up to {top8:.2f} (W={w8}, {SHORT[wl8].replace('DLRMv2 ', '')})"
    gap = max(abs(q["mean"] - q["busiest"]) for r in p.values() for q in r["ratios"].values())
    f["mean_vs_busiest"] = f"{ceil_to(gap, 0.01):.2f}"
    f["est_error"] = f"{ceil_to(max(_est_error(r) for r in p.values()) * 100, 0.1):.1f}%"
    return f


def _step_count_facts(w4: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    """Per-step collectives, host syncs and ops (forward + backward) at W=4: network-priced plan against stock."""
    f: Dict[str, str] = {}
    c = {m: [w4[wl][m]["counts"] for wl in WORKLOADS] for m in (*HYBRID, "stock_planner")}
    f["w4_net_collectives"] = span((_total(x, "collectives") for x in c["hybrid_planner_bytes"]), str)
    f["w4_stock_collectives"] = span((_total(x, "collectives") for x in c["stock_planner"]), str)
    net_most = max(_total(x, "collectives") for x in c["hybrid_planner_bytes"])
    stock_least = min(_total(x, "collectives") for x in c["stock_planner"])
    f["w4_collectives_cmp"] = ("fewer than" if net_most < stock_least else "as many as" if net_most == stock_least
                               else "more than")
    f["w4_net_syncs"] = span((_total(x, "host_syncs") for x in c["hybrid_planner_bytes"]), str)
    f["w4_stock_syncs"] = span((_total(x, "host_syncs") for x in c["stock_planner"]), str)
    f["w4_syncs_ratio"] = span((_total(h, "host_syncs") / _total(s, "host_syncs")
                                for h, s in zip(c["hybrid_planner_bytes"], c["stock_planner"])), lambda v: f"{v:.1f}x")
    f["w4_ops_ratio"] = span((_total(h, "ops") / _total(s, "ops")
                              for h, s in zip(c["hybrid_planner_bytes"], c["stock_planner"])), lambda v: f"{v:.1f}x")
    return f


def _calibration_facts() -> Dict[str, str]:
    """The cost-model fit (python -m benchmarks.calibrate): its RMS error, the measured steps and how many runs."""
    cal, dense = load("calibration"), load("calibration_dense")["fit"]
    return {"cal_rms": f"{cal['fit']['rms_ms']:.1f} ms",
            "cal_steps": span((q["measured_mean_ms"] for q in cal["fit"]["per_plan"]), lambda v: f"{v:.0f} ms"),
            "cal_runs": _count_words(len(cal["args"]["refit"] or [1]), "run"),
            "dense_rms": f"{dense['rms_ms']:.1f} ms", "dense_rel": f"{dense['rms_rel']:.0%}"}


def _count_words(n: int, noun: str) -> str:
    """``3, "run"`` -> ``"three runs"`` (numbers up to ten in words, as the docs write them)."""
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    return f"{words[n] if n < len(words) else n} {noun}{'' if n == 1 else 's'}"


def _projection_facts() -> Dict[str, str]:
    """The projection to large W (python -m benchmarks.simulate [--multi-hot]): worlds, setup and byte ratios."""
    f: Dict[str, str] = {}
    one, multi = load("projected"), load("projected_multihot")
    f["proj_max_w"] = f"{max(one['worlds']):,}"
    f["proj_min_w"], f["proj_max_w_plain"] = str(min(one["worlds"])), str(max(one["worlds"]))
    if one["worlds"] != multi["worlds"]:
        raise ValueError("the two projections differ in their world sizes")
    f["proj_onehot"] = span(_projection_ratios("projected", "frequency_hybrid_best_H"), x2)
    tw_cold = _projection_ratios("projected_multihot", "frequency_hybrid_table_wise_cold")
    rw_cold = _projection_ratios("projected_multihot", "frequency_hybrid_row_wise_cold")
    f["proj_tw_cold"] = span(tw_cold, x2)
    f["proj_tw_cold_last"] = x2(tw_cold[-1])
    f["proj_rw_cold_first"], f["proj_rw_cold_last"] = f"{rw_cold[0]:.1f}x", f"{rw_cold[-1]:.1f}x"
    f["proj_rw_cold_exact"] = f"{x2(rw_cold[0])}, {x2(rw_cold[-1])}"
    f["proj_setup"] = (f"Zipf({one['alpha']}), dim {one['dim']}, B={one['batch_per_rank']} per rank")
    f["proj_cap"] = f"{max(one['cardinalities']) // 1_000_000}M"
    if multi["alpha"] != one["alpha"] or multi["dim"] != one["dim"]:
        raise ValueError("the two projections differ in alpha or dim")
    return f


def _drift_facts() -> Dict[str, str]:
    """The drift run (python -m benchmarks.drift): setup, static vs refreshed vs ideal bytes, refresh costs."""
    f: Dict[str, str] = {}
    d = load("drift")
    runs, acc, ref = d["runs"], d["acceptance"], d["refresh"]
    f["drift_within"] = f"{math.ceil((acc['refreshed_max_over_ideal'] - 1) * 100)}%"
    f["drift_steps"] = f"{d['steps']:,}"
    f["drift_wall"] = f"{d['wall_s']:.0f} s"
    f["drift_minutes"] = f"~{round(d['wall_s'] / 60)} min"
    f["drift_point"] = str(d["args"]["point"])
    f["drift_static_last"] = x2(acc["static_last_over_ideal"])
    f["drift_static_first"] = x2(acc["static_last_over_first"])
    f["drift_every"] = str(ref["every"])
    f["drift_decay"] = str(d["args"]["decay"])
    f["drift_merge_mb"] = f"{ref['mean_merge_bytes_per_rank'] / 1e6:.1f} MB"
    f["drift_merge_mb3"] = f"{ref['mean_merge_bytes_per_rank'] / 1e6:.2f} MB"
    f["drift_refresh_ms"] = f"{ref['mean_time_s'] * 1e3:.0f} ms mean, {ref['max_time_s'] * 1e3:.0f} ms max"
    f["drift_rows"] = f"{d['rows']:,}"
    f["drift_bytes_per_row"] = str(round(d["stats_bytes_per_rank"] / d["rows"]))
    f["drift_switch"] = f"{ref['mean_switch_bytes_per_rank'] / 1e3:.0f} kB"
    with_refresh = runs["refreshed"]["mean_bytes_with_refresh"]
    f["drift_merge_per_step"] = f"{(with_refresh - runs['refreshed']['mean_bytes']) / 1e6:.2f} MB"
    f["drift_with_refresh"] = f"{with_refresh / 1e6:.3f} MB"
    f["drift_with_refresh_vs_static"] = x2(with_refresh / runs["static"]["mean_bytes"])
    f["drift_with_refresh_vs_ideal"] = x2(with_refresh / runs["ideal"]["mean_bytes"])
    f["drift_hot_rows"] = f"{d['hot_rows']:,}"
    f["drift_stats_batches"] = str(d["args"]["stats_batches"])
    f["drift_setup"] = (f"{d['world']} gloo ranks (`--world`), the 26 Criteo-Kaggle tables capped at "
                        f"{d['args']['rows_cap'] // 1000}k rows, dim {d['args']['dim']}, B={d['args']['batch']} per "
                        f"rank, one id per feature, Zipf({d['args']['alpha']})")
    return f


def _headline_and_sweep_facts() -> Dict[str, str]:
    """The headline run and the sweeps (python -m benchmarks [--headline|--quick]), then their run times."""
    hd, full, quick = load("headline"), load("full"), load("quick")
    hc = single(hd["configurations"], "headline configuration")
    f = _headline_facts(hd, hc, full)
    f.update(_sweep_facts(full, quick, hc["workload"]["rows_cap"]))
    f.update(_run_time_facts(hd, full, quick))
    return f


def _headline_facts(hd: Dict[str, Any], hc: Dict[str, Any], full: Dict[str, Any]) -> Dict[str, str]:
    """The headline configuration's setup and step times against the stock types, and its twin in the full sweep."""
    f: Dict[str, str] = {}
    hw = hc["workload"]
    f["hl_setup"] = (f"{hw['batch_per_rank']:,} samples per rank, one id per feature, Zipf({hw['alpha']}), "
                     f"{hw['hot_rows']:,} hot rows, {hw['steps']} timed steps")
    f["hl_machine"] = (f"Headline ({hw['world']} gloo ranks on {hd['machine']['cpus']} CPU cores, 26 Criteo-Kaggle "
                       f"tables capped at {hw['rows_cap'] // 1000}k rows, dim {hw['dim']},")
    f["hl_setup_short"] = f"B={hw['batch_per_rank']}, {hw['hot_rows']:,} hot rows, {hw['steps']} interleaved steps"
    if hw["multi_hot"]:
        raise ValueError("the headline configuration is multi-hot: reword the docs")
    ratio = hc["ratios"]["bytes_hybrid_over_table_wise"]
    f["hl_third"] = "under a third" if ratio < 1 / 3 else f"{x2(ratio)}"
    fc = next(x for x in full["configurations"] if x["workload"]["name"] == hw["name"])
    f["hl_vs_fastest"], f["hl_vs_tw"] = _step_vs_stock(hc)
    f["full_vs_fastest"], f["full_vs_tw"] = _step_vs_stock(fc)
    for key, config in (("hl_fastest", hc), ("full_fastest", fc)):  # each run's own fastest stock plan
        fastest = config["ratios"]["fastest_stock_type"]
        f[key] = "the stock planner's plan" if fastest == "planner" else fastest
    planners = hc["ratios"]["planners"]  # the hybrid planner's plans, in the same run
    for kind in ("hybrid_planner_bytes", "hybrid_planner"):
        if set(hc["results"][kind]["planned_types"]) != {"frequency_hybrid"}:
            raise ValueError(f"the headline's {kind} plan is {hc['results'][kind]['planned_types']}, the docs say "
                             "every table frequency_hybrid: reword them")
    for key, kind in (("hl_net", "hybrid_planner_bytes"), ("hl_cpu", "hybrid_planner")):
        f[f"{key}_bytes"] = x2(planners[kind]["busiest_bytes_over_planner"])
        f[f"{key}_step"] = x2(planners[kind]["time_over_fastest_stock"])
    return f


def _step_vs_stock(config: Dict[str, Any]) -> Tuple[str, str]:
    """The hybrid's median step over the fastest stock type's and over table_wise's, in one configuration."""
    res = config["results"]
    t = res["frequency_hybrid"]["step_time_s"]["median"]
    return (x2(t / res[config["ratios"]["fastest_stock_type"]]["step_time_s"]["median"]),
            x2(t / res["table_wise"]["step_time_s"]["median"]))


def _sweep_facts(full: Dict[str, Any], quick: Dict[str, Any], headline_rows_cap: int) -> Dict[str, str]:
    """The sweeps' configurations on smaller tables than the headline's: setup, time and byte ratios."""
    f: Dict[str, str] = {}
    small = [x for x in full["configurations"] if x["workload"]["rows_cap"] < headline_rows_cap]
    f["sweep_setup"] = (f"B={unique((x['workload']['batch_per_rank'] for x in small), 'sweep batch')}, "
                        f"{unique((x['workload']['rows_cap'] for x in small), 'sweep rows') // 1000}k-row tables")
    times = [x["ratios"]["time_hybrid_over_fastest_stock"] for x in small]
    f["sweep_time"] = span(times, x2)
    f["sweep_time_median"] = f"{statistics.median(times):.1f}"
    # the CPU-priced plan at these sizes: TorchRec's own plan, so its step against that same plan under
    # TorchRec's sharder is our sharder's own cost on stock tables
    for x in small:
        if x["results"]["hybrid_planner"]["planned_types"] != x["results"]["planner"]["planned_types"]:
            raise ValueError(f"{x['workload']['name']}: the CPU-priced plan is not the stock planner's: "
                             "reword the docs")
    same = [x["ratios"]["planners"]["hybrid_planner"]["time_over_planner"] for x in small]
    f["sweep_cpu_same_plan"] = span(same, x2)
    f["sweep_steps"] = str(unique((x["workload"]["steps"] for x in small), "sweep steps"))
    f["sweep_cpu_same_plan_median"] = x2(statistics.median(same))
    f["sweep_cpu_types"] = unique((types_text(x["results"]["hybrid_planner"]["planned_types"]) for x in small),
                                  "sweep CPU-priced plan types")
    for key, kind in (("sweep_net", "hybrid_planner_bytes"), ("sweep_cpu", "hybrid_planner")):
        q = [x["ratios"]["planners"][kind] for x in small]
        f[f"{key}_time"] = span((r["time_over_fastest_stock"] for r in q), x2)
        f[f"{key}_time_median"] = x2(statistics.median(r["time_over_fastest_stock"] for r in q))
        f[f"{key}_bytes"] = span((r["busiest_bytes_over_planner"] for r in q), x2)
    mh = [x for x in small if x["workload"]["multi_hot"]]
    f["sweep_hot_rows"] = str(unique((x["workload"]["hot_rows"] for x in small), "sweep hot rows"))
    f["sweep_multihot"] = span((x["ratios"]["bytes_hybrid_over_table_wise"] for x in mh), x2)
    f["sweep_multihot_over"] = _sweep_multihot_over(mh)
    f["sweep_uniform"] = span((x["ratios"]["bytes_hybrid_over_table_wise"] for x in small
                               if not x["workload"]["multi_hot"] and x["workload"]["alpha"] == 0), x2)
    qmh = [x["ratios"]["bytes_hybrid_over_table_wise"] for x in quick["configurations"] if x["workload"]["multi_hot"]]
    f["quick_multihot"] = ("slightly *more* than" if all(1 < v < 1.1 for v in qmh) else
                           f"{span(qmh, x2)} of") + " table_wise"
    return f


def _sweep_multihot_over(mh: List[Dict[str, Any]]) -> str:
    """Which multi-hot sweep configurations send more than table_wise, by W: the docs name them."""
    over: Dict[int, List[str]] = {}
    for x in mh:
        if x["ratios"]["bytes_hybrid_over_table_wise"] > 1:
            a = x["workload"]["alpha"]
            label = "uniform" if a == 0 else f"Zipf {a}"
            over.setdefault(x["workload"]["world"], [])
            if label not in over[x["workload"]["world"]]:
                over[x["workload"]["world"]].append(label)
    n_over = sum(x["ratios"]["bytes_hybrid_over_table_wise"] > 1 for x in mh)
    return (f"more than table_wise in {n_over} of {len(mh)} configurations: "
            + "; ".join(f"W={w}: {', '.join(v)}" for w, v in sorted(over.items())))


def _run_time_facts(hd: Dict[str, Any], full: Dict[str, Any], quick: Dict[str, Any]) -> Dict[str, str]:
    """How long the sweeps and the headline took, as the docs quote them (minutes, budgets)."""
    return {"quick_minutes": _minutes(quick["runtime_s"]),
            "full_minutes": _minutes(full["runtime_s"]),
            "headline_minutes": f"~{max(1, round(hd['runtime_s'] / 60))} min",
            "quick_budget": "< 5 min" if quick["runtime_s"] < 300 else f"~{round(quick['runtime_s'] / 60)} min",
            "full_budget": "< 15 min" if full["runtime_s"] < 900 else f"~{round(full['runtime_s'] / 60)} min"}


# (doc, template): the filled template must stand in the doc, whitespace folded
SNIPPETS: List[Tuple[str, str]] = [
    # docs/results.md: every candidate plan, trained (benchmarks.candidates)
    ("docs/results.md", "({cand_steps} interleaved steps at W={cand_world}; identical candidates train once)"),
    ("docs/results.md", "orders its {cand_n} candidates as their measured process CPU on {cand_cpu_agree} workloads "
                        "({cand_workloads}) and as their median steps on {cand_step_agree}; the plan it returned "
                        "was the fastest it weighed on {cand_cpu_fastest}"),
    ("docs/results.md", "slower than the best pure candidate, and priced dearer, on {cand_mixed_slower} workloads"),
    ("docs/results.md", "its choice was the fastest of its candidates on {cand_net_fastest} workloads"),
    ("docs/results.md", "the median of those ratios and a distribution-free 95% interval of the median "
                        "(`paired_step_ci` in the results files; order statistics), over the timed steps of "
                        "{product_repeats_words} runs, each in fresh processes (`--repeats {product_repeats}`: "
                        "{product_pooled_steps} steps)"),
    # README.md and docs/results.md: the allocator (benchmarks/malloc.py; product_w4 against product_w4_glibc)
    ("README.md", "under glibc's defaults (`--malloc default`: `product_w4_glibc.md`) TorchRec's one-hot plan took "
                  "{alloc_onehot_stock_faults} minor page faults per step on its busiest rank and the hybrid "
                  "{alloc_onehot_cpu_faults}, and the one-hot step ratio was {alloc_onehot_default} instead of "
                  "{alloc_onehot_fixed}"),
    ("docs/results.md", "Every rank runs with glibc's malloc thresholds fixed (`benchmarks/malloc.py`: {alloc_fixed})"),
    ("docs/results.md", "TorchRec's one-hot plan took {alloc_onehot_stock_faults} page faults per step on its "
                        "busiest rank and the CPU-priced hybrid plan {alloc_onehot_cpu_faults}, and the hybrid's "
                        "paired step was {alloc_onehot_default} the stock step, against {alloc_onehot_fixed} with the "
                        "thresholds fixed (at most {alloc_fixed_faults} faults per step for any plan); with multi-hot "
                        "bags, where TorchRec's plan is also the CPU-priced one, {alloc_multihot_stock_faults} and "
                        "{alloc_multihot_cpu_faults} faults, {alloc_multihot_default} against {alloc_multihot_fixed}"),
    # README.md and docs/results.md: the collectives' share of a step (comm_floor.json; the script left the tree)
    ("README.md", "one all-to-all of under 0.3 MB took {cf_small_ms} alone (the slowest of {cf_world} ranks), so the "
                  "stock plan's {cf_oh_stock_n} collectives are {cf_oh_share} of its one-hot step and the CPU-priced "
                  "hybrid's {cf_oh_n} take {cf_oh_time} their time for {cf_oh_bytes} their bytes; with the stock "
                  "plan's compute it would step {cf_oh_bound} the stock step, and its own compute and waiting add "
                  "{cf_oh_excess} per step"),
    ("docs/results.md", "{cf_runs} runs of {cf_steps} interleaved steps at W={cf_world}"),
    ("docs/results.md", "an all-to-all of under 0.3 MB took {cf_small_ms} alone"),
    ("docs/results.md", "With one id per feature the stock plan's {cf_oh_stock_n} collectives are {cf_oh_share} of "
                        "its step; the CPU-priced hybrid plan's {cf_oh_n} send {cf_oh_bytes} their bytes in "
                        "{cf_oh_time} their time, which with the stock plan's compute would make a step of "
                        "{cf_oh_bound} the stock step; it ran {cf_oh_step}, its compute and waiting {cf_oh_excess} "
                        "more than stock's"),
    ("docs/results.md", "With multi-hot bags the collectives are {cf_mh_share} of the stock step; the network-priced "
                        "plan's send {cf_mh_bytes} the bytes in {cf_mh_time} the time (bound {cf_mh_bound}) and it "
                        "ran {cf_mh_step}, {cf_mh_excess} more compute and waiting"),
    # README.md: the product
    ("README.md", "python -m benchmarks.product {w4_cmd}"),
    ("README.md", "{w4_setup}"),
    ("README.md", "statistics from {stats_batches} other batches"),
    ("README.md", "{w4_steps} steps interleaved"),
    ("README.md", "frequency_hybrid with one id per feature: {w4_cpu_hybrid_bytes} the stock planner's busiest-rank "
                  "bytes at {w4_cpu_hybrid_step} its step. With multi-hot bags or uniform ids it returns TorchRec's "
                  "own plan ({w4_cpu_types_stock}), which under our sharder ran {w4_cpu_stock_step} its step"),
    ("README.md", "re-fit on steps with a dense gradient (`calibration_dense.md`, RMS {dense_rms} per rank, "
                  "{dense_rel} of a rank's time)"),
    ("README.md", "Each ratio pools {product_repeats_words} runs in fresh processes on a shared box, and still moves "
                  "by a few percent: the same two plans on the same batches up to a relabelling of the ids (multi-hot "
                  "and frequency-sorted multi-hot) measured {w4_relabel}"),
    ("README.md", "it picks frequency_hybrid for {w4_net_tables} tables: {w4_net_onehot} the bytes one-hot, "
                  "{w4_net_multihot} multi-hot, balanced on sorted ids (busiest / mean <= {w4_net_sorted_balance}), "
                  "but {w4_net_slow} the step here with multi-hot bags or uniform ids"),
    ("README.md", "Per step that plan issues {w4_net_collectives} collectives (forward + backward), "
                  "{w4_collectives_cmp} the stock plan ({w4_stock_collectives}), {w4_net_syncs} host syncs against "
                  "{w4_stock_syncs} and "
                  "{w4_ops_ratio} the dispatched ops"),
    ("README.md", "Projected to {proj_max_w} ranks"),
    ("README.md", "table-wise cold stays at {proj_tw_cold_last} table_wise's bytes with multi-hot bags, "
                  "row-wise cold grows to {proj_rw_cold_last}"),
    # README.md: drift
    ("README.md", "the refreshed hot set stays within {drift_within} of an ideal one over {drift_steps} steps "
                  "while a static one ends at {drift_static_last} its bytes"),
    ("README.md", "({drift_merge_mb} per rank every {drift_every} steps there: with it, "
                  "{drift_with_refresh_vs_ideal} the ideal's bytes)"),
    # README.md: benchmarks
    ("README.md", "`.venv/bin/python -m benchmarks --quick` (about {quick_minutes}; the full default run takes "
                  "about {full_minutes}"),
    ("README.md", "{hl_machine} {hl_setup};"),
    ("README.md", "The hybrid sends {hl_third} of table_wise's bytes."),
    ("README.md", "its median step was {hl_vs_fastest} the fastest stock plan's ({hl_fastest}) and {hl_vs_tw} "
                  "hand-placed table_wise's in the run above, and {full_vs_fastest} ({full_fastest}) and "
                  "{full_vs_tw} in the same configuration of the full run (`full.md`)"),
    ("README.md", "priced for a network-bound cluster it makes every table frequency_hybrid: {hl_net_bytes} the "
                  "stock planner's busiest-rank bytes at {hl_net_step} the fastest stock plan's median step; priced "
                  "by this box's CPU fit (the default here) it does too: {hl_cpu_bytes} and {hl_cpu_step}"),
    ("README.md", "At the smaller sweep sizes ({sweep_setup}; `full.json`) that fixed per-step cost makes it "
                  "{sweep_time} as slow as the fastest stock plan (median {sweep_time_median})"),
    ("README.md", "The hybrid planner's own plans there: network-priced {sweep_net_bytes} the stock planner's "
                  "busiest-rank bytes at {sweep_net_time} the fastest stock plan's step "
                  "(median {sweep_net_time_median}), CPU-priced {sweep_cpu_bytes} at {sweep_cpu_time} "
                  "(median {sweep_cpu_time_median}): with the fit calibrated at these sizes too, it returns "
                  "TorchRec's own plan ({sweep_cpu_types}) at every one of them, which under our sharder ran "
                  "{sweep_cpu_same_plan} (median {sweep_cpu_same_plan_median}) the same plan under TorchRec's"),
    ("README.md", "Multi-hot (DLRMv2 sizes) with only {sweep_hot_rows} hot rows sends {sweep_multihot} "
                  "table_wise's bytes ({sweep_multihot_over}), one-hot uniform ids {sweep_uniform}"),
    ("README.md", "the hybrid stays at {proj_onehot} table_wise"),
    # docs/results.md: the product
    ("docs/results.md", "`python -m benchmarks.product {w4_cmd}` -> `benchmarks/results/product_w4.md`; "
                        "`{w28_cmd}` -> `product_w28.md`"),
    ("docs/results.md", "statistics from {stats_batches} other batches"),
    ("docs/results.md", "One-hot B={batch_onehot} per rank, multi-hot B={batch_multihot}."),
    ("docs/results.md", "{net_tables} frequency_hybrid tables (with multi-hot bags {net_tw_cold_multihot} of them "
                        "with table-wise cold)"),
    ("docs/results.md", "(mean-rank ratio within {mean_vs_busiest} of it everywhere; the planner's per-rank "
                        "estimate within {est_error} for every plan)"),
    ("docs/results.md", "Busiest rank / mean rank of the network-priced plan: {net_balance_small} (W=2, 4), "
                        "{net_balance_big}."),
    ("docs/results.md", "Each step ratio pools {product_repeats_words} runs on a shared box; how far such ratios "
                        "still move: the same two plans on the same batches up to a relabelling of the ids "
                        "(CPU-priced, multi-hot vs frequency-sorted multi-hot, stock types in both) measured "
                        "{relabel}. Their byte ratios are equal."),
    ("docs/results.md", "The hybrid issues {w4_net_collectives} collectives per step, {w4_collectives_cmp} "
                        "the stock plan ({w4_stock_collectives}); it has {w4_syncs_ratio} the host syncs (one read of "
                        "the cold exchange's split sizes, the rest KJT's and FBGEMM's own) and {w4_ops_ratio} the "
                        "dispatched ops (forward + backward)."),
    ("docs/results.md", "{hl_setup_short}"),
    ("docs/results.md", "the network-priced plan is {net_slow_w48} the stock step at W=4 and 8 with multi-hot "
                        "bags or uniform ids. The CPU fit measures that work, and the CPU-priced planner returns "
                        "TorchRec's own plan for those workloads ({cpu_stock_step} the stock step, {cpu_stock_bytes} "
                        "the bytes"),
    ("docs/results.md", "the CPU-priced plan is all hybrid: {cpu_hybrid_bytes} the bytes at {cpu_hybrid_step} the "
                        "step. The fit (RMS {cal_rms} per rank on {cal_steps} of CPU per rank and step, "
                        "{cal_runs} on a shared box: "
                        "calibration.json) ranks the CPU-priced plan {w4_cpu_cost} the stock plan's cost at W=4"),
    ("docs/results.md", "{proj_cap}-row cap), {proj_setup}"),
    ("docs/results.md", "the extra backward per id is {tbe_extra_share} of a one-feature lookup's forward + "
                        "backward per id"),
    ("docs/results.md", "{dc_kernel_ms} ms of a {dc_step_ms} ms step at W=1 on one {dc_gpu}, the rest is the host "
                        "launching about {dc_launches} kernels (some {dc_per_launch_us} µs each"),
    # benchmarks/README.md
    ("benchmarks/README.md", "--headline   # the acceptance configuration alone ({headline_minutes} here)"),
    ("benchmarks/README.md", "--quick      # {quick_budget} on 2 CPU cores"),
    ("benchmarks/README.md", "# {full_budget}: full sweep"),
    ("benchmarks/README.md", "python -m benchmarks.product {w4_cmd} --out out/product_w4 "),
    ("benchmarks/README.md", "python -m benchmarks.product {w28_cmd} --out out/product_w28 "),
    ("benchmarks/README.md", "python -m benchmarks.drift                        # {drift_minutes} here"),
    ("benchmarks/README.md", "{drift_setup}"),
    ("benchmarks/README.md", "the {drift_hot_rows} most frequent rows of {drift_stats_batches} earlier batches hot"),
    ("benchmarks/README.md", "decayed by {drift_decay} per batch, and every {drift_every} steps"),
    ("benchmarks/README.md", "Committed run ({drift_steps} steps, {drift_wall};"),
    ("benchmarks/README.md", "The refreshed hot set stays within {drift_within} of the ideal at every point "
                             "({drift_point} steps each); the frozen one nearly doubles its bytes "
                             "({drift_static_first} its first point, {drift_static_last} the ideal at the end)"),
    ("benchmarks/README.md", "A refresh costs {drift_refresh_ms} (slowest rank, merge + switch) and "
                             "{drift_merge_mb3} per rank for the merge: one all-reduce of the hybrid tables' "
                             "counters, {drift_bytes_per_row} bytes per row, here {drift_rows} rows; the switch "
                             "itself sends {drift_switch}"),
    ("benchmarks/README.md", "the merge adds {drift_merge_per_step} per step, so on these tables refreshed + merge "
                             "is {drift_with_refresh}/step: {drift_with_refresh_vs_static} static but "
                             "{drift_with_refresh_vs_ideal} ideal"),
    ("benchmarks/README.md", "the hybrid sent {quick_multihot} in the quick run"),
    ("benchmarks/README.md", "stays at {proj_onehot} table_wise from W={proj_min_w} to W={proj_max_w_plain}"),
    ("benchmarks/README.md", "row-wise cold grows from {proj_rw_cold_first} table_wise at W={proj_min_w} to "
                             "{proj_rw_cold_last} at W={proj_max_w_plain} ({proj_rw_cold_exact})"),
    ("benchmarks/README.md", "table-wise cold stays at {proj_tw_cold} table_wise at every W"),
]


# ---------------------------------------------------------------- check / write


def fold(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def marked(text: str, name: str) -> str:
    start = START.format(name)
    if start not in text or END not in text.split(start, 1)[1]:
        raise KeyError(f"no table markers for {name!r}")
    return text.split(start, 1)[1].split(END, 1)[0]


# a measured figure: a ratio (0.66x, 0.86-1.13x), a size or time (6.7 MB, 17 kB, 46 ms, 165 s), a percentage
# or a duration in minutes; wall times in seconds only as "<n> s" before ";" or ")" (not "s" of a word)
FIGURE = re.compile(r"(?<![\w.])\d[\d.,]*(?:-\d[\d.,]*)?(?:x\b|%|\s?(?:MB|kB|ms)\b|\s(?:minutes?|min)\b|\ss(?=[;)]))")


def unbound_figures(name: str, text: str, fact: Dict[str, str]) -> List[str]:
    """Figures in ``text`` that are neither in a generated table nor in a checked snippet."""
    for table, (doc, _) in TABLES.items():
        if doc == name and START.format(table) in text:
            text = text.replace(marked(text, table), "\n")
    text = fold(text)
    for doc, template in SNIPPETS:
        if doc == name:
            text = text.replace(fold(template.format(**fact)), " ")
    return [m.group(0) for m in FIGURE.finditer(text)]


def check() -> List[str]:
    """Every drifted figure, as a sentence naming the doc and what the results file says."""
    problems = []
    fact = facts()
    texts = {}
    for name, path in DOCS.items():
        with open(path) as f:
            texts[name] = f.read()
    for table, (doc, render) in TABLES.items():
        try:
            got = marked(texts[doc], table).strip()
        except KeyError as e:
            problems.append(f"{doc}: {e.args[0]}")
            continue
        want = render()
        if got != want:
            problems.append(f"{doc}: table {table} drifted from its results file; want\n{want}\ngot\n{got}")
    for doc, template in SNIPPETS:
        want = fold(template.format(**fact))
        if want not in fold(texts[doc]):
            problems.append(f"{doc}: expected the sentence {want!r} (figures from the results files)")
    for name, text in texts.items():
        stray = unbound_figures(name, text, fact)
        if stray:
            problems.append(f"{name}: figures bound to no results file: {stray}")
    return problems


def write() -> List[str]:
    """Rewrite every marked table from the results files; returns the docs changed."""
    changed = []
    for name, path in DOCS.items():
        with open(path) as f:
            text = f.read()
        new = text
        for table, (doc, render) in TABLES.items():
            if doc == name:  # splice between this table's markers (an empty body is no pattern)
                head, rest = new.split(START.format(table), 1)
                new = head + START.format(table) + "\n\n" + render() + "\n\n" + END + rest.split(END, 1)[1]
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            changed.append(name)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the marked tables, then check")
    a = ap.parse_args(argv)
    if a.write:
        for name in write():
            print(f"rewrote tables in {name}")
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(TABLES)} tables and {len(SNIPPETS)} sentences match benchmarks/results/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
