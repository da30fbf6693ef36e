"""The docs' tables, rendered from the results files, and a check that every figure in the docs is in one.

    .venv/bin/python -m benchmarks.docs_figures            # check: names what drifted (exit 1)
    .venv/bin/python -m benchmarks.docs_figures --write    # render the marked tables again, then check

Nothing is measured here. A table sits between ``<!-- table: NAME ... -->`` and ``<!-- end table -->`` in
README.md, docs/*.md or benchmarks/README.md and is rendered by ``TABLES[NAME]`` from the results files
(``benchmarks/results/*.json``, ``examples/dlrm/results/*.json``). The check fails when a table is not what
its results file renders, and when a figure in the prose - a ratio ``0.54x``, a size ``3.23 MB``, a time
``72.9 ms``, a percentage ``48%``, a rate ``2.09 Gbit/s``; code, comments and tables left out - is in no
results file: some number there, in one of the figure's units, must round to it at its printed precision
(a ratio may also be the quotient of two numbers of one quantity: two entries of one file whose paths
differ in one key, e.g. two plans' ``busiest_bytes``). Figures that are no measurement (a budget, a
setting, a target quoted from an issue) stand in ``ALLOWED`` with their reason. Prose is free to reword.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import re
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from benchmarks.measure import ci_text
from benchmarks.qcomms import markdown as qcomms_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_GLOBS = ("benchmarks/results/*.json", "examples/dlrm/results/*.json")
DOC_GLOBS = ("README.md", "docs/*.md", "benchmarks/README.md")
START = "<!-- table: {} (python -m benchmarks.docs_figures --write) -->"
END = "<!-- end table -->"


def load(name: str) -> Dict[str, Any]:
    """A results file by its name (``product_w4``: ``benchmarks/results/product_w4.json``)."""
    with open(result_files()[name]) as f:
        return json.load(f)


# ---------------------------------------------------------------- the product benchmark (benchmarks.product)

WORKLOADS = {"onehot": "one-hot", "multihot": "DLRMv2 multi-hot", "sorted-onehot": "frequency-sorted one-hot",
             "sorted-multihot": "frequency-sorted multi-hot", "uniform": "uniform ids, one-hot"}
PLANS = {"hybrid_planner": "hybrid planner", "hybrid_planner_bytes": "hybrid planner, network-priced",
         "stock_planner": "TorchRec's planner"}
STOCK_CHOICE = "stock: TorchRec's EmbeddingShardingPlanner"  # the planner's name for TorchRec's candidate


def network_text(r: Dict[str, Any]) -> str:
    """``2 (measured 2.08)``: the loopback's rate in Gbit/s (or ``unshaped``) and the all-to-all rate its ranks
    measured, all ranks together."""
    n = r.get("network") or {"rate_bits_per_s": None, "measured": None}
    rate = "unshaped" if n["rate_bits_per_s"] is None else f"{n['rate_bits_per_s'] / 1e9:g}"
    m = n.get("measured")
    return rate + (f" (measured {m['aggregate_gbit_s']:.3g})" if m else "")


def _short_types(types: Dict[str, int], layouts: bool = True) -> str:
    """``12 data_parallel + 14 table_wise``, ``26 frequency_hybrid (25 row-wise cold, 1 table-wise cold)``
    (without ``layouts``: ``26 frequency_hybrid``)."""
    hybrid = {t.split("/")[1].replace("_", "-").replace("-cold", " cold"): n for t, n in sorted(types.items())
              if t.startswith("frequency_hybrid/")}
    parts = [f"{n} {t}" for t, n in sorted(types.items()) if not t.startswith("frequency_hybrid")]
    if hybrid:
        inner = ", ".join(f"{n} {k}" for k, n in hybrid.items())
        parts.append(f"{sum(hybrid.values())} frequency_hybrid" + (f" ({inner})" if layouts else ""))
    return " + ".join(parts)


def returned_text(r: Dict[str, Any], m: str, layouts: bool = True) -> str:
    """What the planner ``m`` returned: TorchRec's own plan, or the plan's types."""
    if STOCK_CHOICE in r["chosen"][m]:
        return "TorchRec's plan"
    return _short_types(r["types"][m], layouts)


def _ops(c: Dict[str, int]) -> int:
    return c["fwd_ops"] + c["bwd_ops"]


def _collectives(c: Dict[str, int]) -> int:
    return c["fwd_collectives"] + c["bwd_collectives"]


def command(args: Dict[str, Any]) -> str:
    """The ``benchmarks.product`` command line that wrote a results file (from its ``args``)."""
    parts = ["python -m benchmarks.product", "--world " + " ".join(map(str, args["world"]))]
    if list(args["workloads"]) != list(WORKLOADS):
        parts.append("--workloads " + " ".join(args["workloads"]))
    parts += [f"--steps {args['steps']}", f"--repeats {args['repeats']}"]
    if args.get("network") and args["network"] != ["unshaped"]:
        parts.append("--network " + " ".join(args["network"]))
    elif args.get("measure_network"):
        parts.append("--measure-network")
    if args.get("malloc", "fixed") != "fixed":
        parts.append(f"--malloc {args['malloc']}")
    if args.get("threads", 1) != 1:
        parts.append(f"--threads {args['threads']}")
    if args.get("prices"):
        parts.append(f"--prices {args['prices']}")
    return " ".join(parts)


def product_rows() -> List[Dict[str, Any]]:
    """The README's rows: the shaped rates of ``product_w4_net`` (its unshaped rows are in ``product_w4``),
    then every workload of ``product_w4``."""
    net = [r for r in load("product_w4_net")["results"] if (r.get("network") or {}).get("rate_bits_per_s")]
    net.sort(key=lambda r: (r["network"]["rate_bits_per_s"], list(WORKLOADS).index(r["workload"])))
    return net + load("product_w4")["results"]


def table_readme_product() -> str:
    """README: what the hybrid planner returns (as a user of this machine gets it) on each workload and
    network, against TorchRec's planner told the same network."""
    rows = ["| network, Gbit/s | workload | hybrid planner returns | TorchRec's planner returns "
            "| busiest-rank bytes vs TorchRec's | step vs TorchRec's: median [95% CI] |",
            "|---|---|---|---|---:|---:|"]
    for r in product_rows():
        q = r["ratios"]["hybrid_planner"]
        rows.append(f"| {network_text(r)} | {WORKLOADS[r['workload']]}, B={r['batch']} "
                    f"| {returned_text(r, 'hybrid_planner', False)} | {_short_types(r['types']['stock_planner'])} "
                    f"| {q['busiest']:.2f}x | {ci_text(q['paired_step_ci'])} |")
    cmds = [command(load(name)["args"]) + f" --out out/{name}" for name in ("product_w4", "product_w4_net")]
    return "\n".join(rows + ["", "```bash"] + cmds + ["```"])


def _product_table(name: str) -> str:
    """docs/results.md: every plan of a product run: its types, bytes, step, ops and CPU against the stock plan."""
    rows = ["| network, Gbit/s | workload | plan | its types | busiest-rank MB (vs TorchRec's) | median step ms "
            "| step vs TorchRec's: median [95% CI] | collectives / ops per step | process CPU vs TorchRec's |",
            "|---|---|---|---|---:|---:|---:|---:|---:|"]
    results = load(name)["results"]
    for r in results:
        s = r["stock_planner"]
        for m, label in PLANS.items():
            p = r[m]
            vs = "" if m == "stock_planner" else f" ({p['busiest_bytes'] / s['busiest_bytes']:.2f}x)"
            step = "-" if m == "stock_planner" else ci_text(r["ratios"][m]["paired_step_ci"])
            cpu = f"{p['cpu_per_step_s'] / s['cpu_per_step_s']:.2f}x" if m != "stock_planner" else "1"
            types = _short_types(r["types"][m]) if m == "stock_planner" else returned_text(r, m)
            rows.append(f"| {network_text(r)} | {WORKLOADS[r['workload']]} | {label} "
                        f"| {types} | {p['busiest_bytes'] / 1e6:.2f}{vs} | {p['median_step_s'] * 1e3:.1f} "
                        f"| {step} | {_collectives(p['counts'])} / {_ops(p['counts'])} | {cpu} |")
    return "\n".join(rows + ["", "```bash", command(load(name)["args"]) + f" --out out/{name}", "```"])


def table_results_product() -> str:
    return _product_table("product_w4")


def table_results_product_net() -> str:
    return _product_table("product_w4_net")



def table_results_rate_per_rank() -> str:
    """docs/results.md: per world size, workload and shaped rate, the rate each rank measured, how long
    the stock planner's plan's busiest rank needs to send its bytes at that rate, its step there and
    unshaped, and the hybrid planner's step against it: what the rate per rank means for a cluster."""
    rows = ["| W | workload | rate, all ranks: set (measured) | measured per rank, Gbit/s "
            "| TorchRec's plan: busiest-rank MB | its bytes at that rate, ms | its step ms (unshaped) "
            "| hybrid planner's step vs TorchRec's |",
            "|---:|---|---|---:|---:|---:|---:|---:|"]
    results = load("product_w28")["results"] + load("product_w4_net")["results"]
    unshaped = {(r["world"], r["workload"]): r["stock_planner"]["median_step_s"] for r in results
                if not (r.get("network") or {}).get("rate_bits_per_s")}
    shaped = [r for r in results if (r.get("network") or {}).get("rate_bits_per_s")]
    for r in sorted(shaped, key=lambda r: (r["world"], list(WORKLOADS).index(r["workload"]),
                                           r["network"]["rate_bits_per_s"])):
        s, rate = r["stock_planner"], r["network"]["measured"]["per_rank_gbit_s"]
        base = unshaped.get((r["world"], r["workload"]))
        rows.append(f"| {r['world']} | {WORKLOADS[r['workload']]} | {network_text(r)} | {rate:.2f} "
                    f"| {s['busiest_bytes'] / 1e6:.2f} | {s['busiest_bytes'] * 8 / (rate * 1e6):.0f} "
                    f"| {s['median_step_s'] * 1e3:.0f} ({'-' if base is None else f'{base * 1e3:.0f}'}) "
                    f"| {ci_text(r['ratios']['hybrid_planner']['paired_step_ci'])} |")
    cmds = [command(load(name)["args"]) + f" --out out/{name}" for name in ("product_w28", "product_w4_net")]
    return "\n".join(rows + ["", "```bash"] + cmds + ["```"])


# ---------------------------------------------------------------- other results files


def table_results_headline() -> str:
    """The main sweep's headline: bytes per rank of every stock type, the hybrid by hand and both planners."""
    c = load("headline")["configurations"][0]
    res = c["results"]
    tw = res["table_wise"]["bytes_per_rank_per_step"]
    names = {"row_wise": "row_wise (by hand)", "frequency_hybrid": "frequency_hybrid (by hand, all tables)",
             "planner": "TorchRec's planner", "hybrid_planner": "hybrid planner, CPU-priced",
             "hybrid_planner_bytes": "hybrid planner, network-priced"}
    rows = ["| plan | MB sent / rank / step (model) | vs table_wise |", "|---|---:|---:|"]
    for t in c["workload"]["types"]:
        b = res[t]["bytes_per_rank_per_step"]
        model = res[t].get("expected_bytes_per_rank_per_step")
        mb = f"{b / 1e6:.2f}" + (f" ({model / 1e6:.2f})" if model and "hybrid" in t else "")
        rows.append(f"| {names.get(t, t)} | {mb} | {b / tw:.2f}x |")
    return "\n".join(rows)


def table_results_projection(worlds: Sequence[int] = (8, 64, 1024)) -> str:
    one, multi = load("projected"), load("projected_multihot")
    rows = ["| W | one-hot: hybrid / table_wise | multi-hot, row-wise cold / table_wise "
            "| multi-hot, table-wise cold / table_wise |", "|---:|---:|---:|---:|"]
    for w in worlds:
        i, j = one["worlds"].index(w), multi["worlds"].index(w)
        b, m = one["bytes"], multi["bytes"]
        rows.append(f"| {w} | {b['frequency_hybrid_best_H'][i] / b['table_wise'][i]:.2f}x "
                    f"| {m['frequency_hybrid_row_wise_cold'][j] / m['table_wise'][j]:.2f}x "
                    f"| {m['frequency_hybrid_table_wise_cold'][j] / m['table_wise'][j]:.2f}x |")
    return "\n".join(rows)


def table_results_drift() -> str:
    d = load("drift")
    ideal, stock = d["runs"]["ideal"]["last_point_bytes"], d["runs"]["stock"]["mean_bytes"]
    rows = ["| plan | MB / rank / step (mean) | last point / ideal | max over points / ideal | vs stock |",
            "|---|---:|---:|---:|---:|"]
    for plan in ("static", "refreshed", "ideal", "stock"):
        r = d["runs"][plan]
        label = "stock (" + _short_types(d["stock_types"]) + ")" if plan == "stock" else plan
        rows.append(f"| {label} | {r['mean_bytes'] / 1e6:.3f} | {r['last_point_bytes'] / ideal:.2f}x "
                    f"| {max(d['ratio_to_ideal'][plan]):.2f}x | {r['mean_bytes'] / stock:.2f}x |")
    return "\n".join(rows)


def table_results_qcomms() -> str:
    return "\n".join(qcomms_markdown(load("qcomms_w4")["results"]))


def table_readme_stacks() -> str:
    """README: the TorchRec stacks the correctness core ran on (``scripts/check_stack.sh``), newest first."""
    rows = ["| torchrec | fbgemm-gpu | torch | checked | tests: passed / failed / skipped | fused ops |",
            "|---|---|---|---|---:|---|"]
    for r in sorted(load("stacks")["runs"], key=lambda r: r["torchrec"], reverse=True):
        rows.append(f"| {r['torchrec']} | {r['fbgemm_gpu']} | {r['torch']} | {r['date']} ({r['commit']}) "
                    f"| {r['passed']} / {r['failed']} / {r['skipped']} | {'built' if r['fused_ops'] else 'fallback'} |")
    return "\n".join(rows)

# name -> (render, the results files it reads)
TABLES: Dict[str, Tuple[Callable[[], str], Tuple[str, ...]]] = {
    "readme_product": (table_readme_product, ("product_w4", "product_w4_net")),
    "readme_stacks": (table_readme_stacks, ("stacks",)),
    "results_product": (table_results_product, ("product_w4",)),
    "results_product_net": (table_results_product_net, ("product_w4_net",)),
    "results_rate_per_rank": (table_results_rate_per_rank, ("product_w28", "product_w4_net")),
    "results_headline": (table_results_headline, ("headline",)),
    "results_projection": (table_results_projection, ("projected", "projected_multihot")),
    "results_drift": (table_results_drift, ("drift",)),
    "results_qcomms": (table_results_qcomms, ("qcomms_w4",)),
}


# ---------------------------------------------------------------- figures in the prose

# Figures that are no measurement: the figure, words that must stand within 100 characters of it, and why.
ALLOWED: List[Tuple[str, str, str]] = [
    ("1.5x", r"op budget|at most|table_wise's ops", "issue 57's op budget, held by tests/test_op_budget.py"),
    ("5%", r"min_saving", "the planner's min_saving default"),
    ("30 ms", r"takes|grows", "measure_network's setting: a collective grows until one takes 30 ms"),
    ("1 s", r"budget", "measure_network's default time budget"),
    ("0.2 ms", r"collective", "cost_model.DEFAULT_COLLECTIVE_MS"),
    ("1 GiB/s", r"gloo_topology|guess", "gloo_topology's default bandwidth"),
    ("32 MiB", r"mmap|threshold", "benchmarks/malloc.py's setting"),
    ("1 GiB", r"trim|heap", "benchmarks/malloc.py's setting"),
    ("4 KiB", r"sizes|from", "measure_network's smallest size"),
    ("512 KB", r"burst", "shaped_loopback.py's token-bucket burst"),
    ("2%", r"spare", "cold_all_to_all.next_room's setting: a room is kept while the runs fit it with 2% to spare"),
    ("95%", r"interval", "the confidence level of the paired step intervals (measure.median_ci)"),
]

NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = (r"x\b(?:\s\[[\d., ]+\])?|%|\s?(?:MB|kB|KB|GB|MiB|KiB|GiB|ms|µs)\b(?!/)|\s?(?:Gbit/s|Mbit/s|MB/s|GB/s|GiB/s)"
        r"|\s(?:s|min|minutes?|hours?)\b")
FIGURE = re.compile(rf"(?<![\w.,/=-])(?P<lo>{NUM})(?:-(?P<hi>{NUM}))?(?P<unit>{UNIT})")

# per unit: the factors a results file's number may be scaled by to print in it (bytes, seconds, bytes/ms, ...)
SCALES: Dict[str, Tuple[float, ...]] = {
    "x": (1.0,), "%": (100.0, 1.0),
    "MB": (1e-6, 1.0), "kB": (1e-3, 1.0), "KB": (1e-3, 1.0), "GB": (1e-9, 1.0),
    "MiB": (2.0 ** -20, 1.0), "KiB": (2.0 ** -10, 1.0), "GiB": (2.0 ** -30, 1.0),
    "ms": (1e3, 1.0), "µs": (1e6, 1e3, 1.0), "s": (1.0, 1e-3), "min": (1 / 60,), "minute": (1 / 60,),
    "minutes": (1 / 60,), "hour": (1 / 3600,), "hours": (1 / 3600,),
    "Gbit/s": (1.0, 1e-9, 8e-6, 8e-9), "Mbit/s": (1.0, 1e-6, 8e-3, 8e-6),
    "MB/s": (1.0, 1e-3, 1e-6), "GB/s": (1.0, 1e-6, 1e-9), "GiB/s": (1.0, 1e3 / 2 ** 30, 2.0 ** -30),
}
RATIO_UNITS = ("x", "%")  # figures a quotient of two like numbers may give (% as 100 x the quotient)
LONG_LIST = 64  # numbers in longer lists of samples (per step, per point) are not figures a doc quotes
RATIO_LIST = 12  # nor, in lists of samples longer than this, parts of a quotient


def result_files() -> Dict[str, str]:
    """Every results file by its name without ``.json`` (``product_w4``, ``default_w2``)."""
    paths = sorted(f for g in RESULT_GLOBS for f in glob.glob(os.path.join(REPO, g)))
    return {os.path.splitext(os.path.basename(p))[0]: p for p in paths}


def _numbers(obj: Any, path: Tuple[Any, ...] = (), longest: int = 0) -> Iterator[Tuple[Tuple[Any, ...], float, int]]:
    """Every number in a JSON document with its path and the length of the longest list of samples on that
    path (a list of numbers or lists; a list of records, dicts, counts for nothing)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, path + (k,), longest)
    elif isinstance(obj, list):
        samples = len(obj) if not any(isinstance(v, dict) for v in obj) else 0
        for i, v in enumerate(obj):
            yield from _numbers(v, path + (i,), max(longest, samples))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and obj == obj:
        yield path, float(obj), longest


class Numbers:
    """One results file's numbers, sorted, and the quotients of like ones: two numbers whose paths differ in
    one key short of the last (the same quantity of two plans, runs or models: ``results.3.hybrid_planner.
    busiest_bytes`` over ``results.3.stock_planner.busiest_bytes``)."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            doc = json.load(f)
        singles, ratios = set(), set()
        groups: Dict[Tuple[Any, ...], List[float]] = {}
        for p, v, longest in _numbers(doc):
            if longest <= LONG_LIST:
                singles.add(abs(v))
            if longest <= RATIO_LIST:
                for k, key in enumerate(p[:-1]):
                    if isinstance(key, str):
                        groups.setdefault((k, p[:k], p[k + 1:]), []).append(v)
        for vs in groups.values():
            ratios.update(abs(a / b) for i, a in enumerate(vs) for j, b in enumerate(vs) if i != j and b)
        self.singles, self.ratios = sorted(singles), sorted(ratios)

    @staticmethod
    def _any_in(values: List[float], lo: float, hi: float) -> bool:
        i = bisect.bisect_left(values, lo)
        return i < len(values) and values[i] <= hi

    def holds(self, text: str, unit: str) -> bool:
        """Whether ``text`` (one number as printed) is one of these numbers, scaled for ``unit``, at the printed
        precision."""
        v = float(text.replace(",", ""))
        decimals = len(text.split(".")[1]) if "." in text else 0
        half = 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12
        if any(self._any_in(self.singles, (v - half) / s, (v + half) / s) for s in SCALES[unit]):
            return True
        s = 100.0 if unit == "%" else 1.0
        return unit in RATIO_UNITS and self._any_in(self.ratios, (v - half) / s, (v + half) / s)


_NUMBERS: Dict[str, Numbers] = {}


def numbers(name: str) -> Numbers:
    if name not in _NUMBERS:
        _NUMBERS[name] = Numbers(result_files()[name])
    return _NUMBERS[name]


def sections(text: str) -> List[Tuple[int, str, str]]:
    """A doc cut at its headings (not at a ``#`` inside a code block): (level, heading, body)."""
    out: List[Tuple[int, str, List[str]]] = [(0, "", [])]
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#{1,6}) (.*)", line)
        if m:
            out.append((len(m.group(1)), m.group(2).strip(), []))
        else:
            out[-1][2].append(line)
    return [(lvl, head, "\n".join(body)) for lvl, head, body in out]


def named_results(text: str) -> List[str]:
    """The results files a piece of a doc names (``product_w4.json``, ``drift.md``) or renders a table from."""
    known = result_files()
    names = [n for n in re.findall(r"([A-Za-z0-9_]+)\.(?:json|md|png)\b", text) if n in known]
    for table in marked_tables(text):
        names += [n for n in TABLES.get(table, (None, ()))[1] if n in known]
    return list(dict.fromkeys(names))


def prose(text: str) -> str:
    """A doc without what is not prose: code blocks and spans, HTML comments, marked tables, link targets."""
    text = re.sub(r"<!-- table: .*?" + re.escape(END), " ", text, flags=re.S)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(text: str) -> Iterator[Tuple[str, str, List[str], int]]:
    """Each figure of a piece of prose: as printed, its unit, its numbers, its offset."""
    for m in FIGURE.finditer(text):
        unit = m.group("unit").strip()
        nums = [m.group("lo")] + ([m.group("hi")] if m.group("hi") else [])
        if unit.startswith("x"):
            nums += re.findall(NUM, unit[1:])  # the interval of a ratio: 0.54x [0.53, 0.55]
            unit = "x"
        yield m.group(0), unit, nums, m.start()


def _allowed(printed: str, around: str) -> bool:
    return any(printed == fig and re.search(ctx, around) for fig, ctx, _ in ALLOWED)


def unbacked_figures(text: str) -> List[str]:
    """The figures of a doc that no results file its section names holds, and ``ALLOWED`` does not name. A
    section's results files are those it names or renders a table from, and those of the sections above it
    (a ``###`` section's ``##``, and the doc's opening lines)."""
    out = []
    scope: List[Tuple[int, List[str]]] = []  # (level, names) of the enclosing sections
    for level, head, body in sections(text):
        while scope and scope[-1][0] >= level:
            scope.pop()
        scope.append((level, named_results(head + "\n" + body)))
        names = list(dict.fromkeys(n for _, ns in scope for n in ns))
        flat = prose(head + "\n" + body)
        for printed, unit, nums, at in figures(flat):
            if any(all(numbers(n).holds(x, unit) for x in nums) for n in names):
                continue
            if _allowed(printed, flat[max(0, at - 100):at + len(printed) + 100]):
                continue
            out.append(f"{printed} ({head or 'top'}: " + (f"not in {', '.join(names)}" if names else
                                                             "the section names no results file") + ")")
    return out


# ---------------------------------------------------------------- check / write


def docs() -> Dict[str, str]:
    """Every checked doc, by its path from the repository root."""
    paths = sorted(f for g in DOC_GLOBS for f in glob.glob(os.path.join(REPO, g)))
    return {os.path.relpath(p, REPO): p for p in paths}


def marked_tables(text: str) -> Dict[str, str]:
    """The marked tables of a doc: name -> body."""
    return {m.group(1): m.group(2) for m in re.finditer(
        r"<!-- table: (\S+) \(python -m benchmarks\.docs_figures --write\) -->(.*?)" + re.escape(END), text, re.S)}


def check(texts: Optional[Dict[str, str]] = None) -> List[str]:
    """Every problem: a table that is not what its results files render, a figure that no results file holds."""
    if texts is None:
        texts = {}
        for name, path in docs().items():
            with open(path) as f:
                texts[name] = f.read()
    problems = []
    for name, text in texts.items():
        for table, body in marked_tables(text).items():
            if table not in TABLES:
                problems.append(f"{name}: table {table}: no such table in benchmarks/docs_figures.py")
                continue
            try:
                want = TABLES[table][0]()
            except (OSError, KeyError, ValueError) as e:  # a results file missing, or of another schema
                problems.append(f"{name}: table {table}: its results files do not render: {e!r}")
                continue
            if body.strip() != want:
                problems.append(f"{name}: table {table} drifted from its results file "
                                f"(python -m benchmarks.docs_figures --write); want\n{want}\ngot\n{body.strip()}")
        stray = unbacked_figures(text)
        if stray:
            problems.append(f"{name}: figures in no results file: " + "; ".join(stray))
    return problems


def write() -> List[str]:
    """Render every marked table again from the results files; returns the docs changed."""
    changed = []
    for name, path in docs().items():
        with open(path) as f:
            text = f.read()
        new = text
        for table in marked_tables(text):
            if table in TABLES:
                head, rest = new.split(START.format(table), 1)
                new = head + START.format(table) + "\n\n" + TABLES[table][0]() + "\n\n" + END + rest.split(END, 1)[1]
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            changed.append(name)
    return changed


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="render the marked tables again, then check")
    a = ap.parse_args(argv)
    if a.write:
        for name in write():
            print(f"rendered the tables of {name} again")
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(docs())} docs: every table is its results file's, every figure is in a results file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
