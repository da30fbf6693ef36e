"""One entry point for every benchmark: frequency_hybrid against stock TorchRec sharding.

    python -m benchmarks [--tiny | --quick | --headline] [--out DIR] [overrides]   (default: the full run)

--tiny      seconds; one of each kind of configuration at toy sizes (what the tests run)
--quick     < 5 min on a 2-core CPU box: a subset of the sweep (SUBSETS), the hot-row sweep,
            the simulator
--headline  the core issue's acceptance configuration alone; prints its ratios
(default)   < 15 min: headline + W in {2, 4} x {ebc, dlrm} x {one-hot, multi-hot} x
            {Zipf 1.05, 1.1, 1.2, uniform} at a smaller table cap, hot-row sweep, simulator

Overrides (--world, --batch, --rows-cap, --dim, --alpha, --multi-hot/--one-hot, --model,
--hot-rows, --steps, --warmup) set that field in every configuration of the mode; a flag given
several values (``--world 2 4``) runs every configuration at each.

Writes into --out (default ./out/benchmarks, which .gitignore covers; the committed results
are regenerated only with ``--out benchmarks/results``): <mode>.json and <mode>.md, plots
<mode>_bytes_vs_alpha.png and <mode>_bytes_vs_hot_rows.png, and (quick/full) projected.{json,md}
+ projected_bytes_vs_W.png.
"""

import argparse
import json
import logging
import os
import platform
import signal
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.config import (  # noqa: E402
    HEADLINE,
    Workload,
    apply_overrides,
    check_override,
    hot_row_sweep,
    mode_workloads,
    sweep_overrides,
)

logger = logging.getLogger("benchmarks")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # committed results
DEFAULT_OUT = os.path.join("out", "benchmarks")  # relative to the working directory; .gitignore has /out/
TARGETS = {"bytes_hybrid_over_table_wise": 0.5, "time_hybrid_over_fastest_stock": 1.1}
SUBSETS = {
    "tiny": "W=2 only: ebc one-hot at Zipf 1.1 and uniform, dlrm multi-hot at Zipf 1.1; toy sizes "
            "(cap 2,000 rows, dim 16, B=64, 200 hot rows); 3 timed steps - a smoke test, not a benchmark",
    "quick": "ebc one-hot at W=2 for Zipf 1.05/1.1/1.2/uniform and at W=4 for Zipf 1.1/uniform; W=4 dlrm "
             "one-hot and ebc multi-hot at Zipf 1.1; 26 tables capped at 10,000 rows, dim 64, B=256 per "
             "rank, 500 hot rows, 6 timed steps after 1 warm-up; the headline is not part of quick "
             "(python benchmarks/run.py --headline)",
    "full": "the headline, plus all of W in {2,4} x {ebc,dlrm} x {one-hot,multi-hot} x {Zipf 1.05,1.1,1.2,"
            "uniform} at the quick sizes (cap 10,000 rows, B=256, 500 hot rows), 40 timed steps after 2 warm-up",
    "headline": "the acceptance configuration only",
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(workloads: List[Workload]) -> List[Dict]:
    """Runs workloads grouped by (world, device) in one process group each; summaries in order.

    Progress: rank 0 of each group shows a tqdm bar over its configurations; each group
    is announced with how many configurations the run has done and has left.
    """
    from benchmarks.spawner import run_group
    from benchmarks.report import summarize

    groups: Dict[tuple, List[int]] = {}
    for i, w in enumerate(workloads):
        groups.setdefault((w.world, w.device), []).append(i)
    out: List[Dict] = [None] * len(workloads)
    done, t0 = 0, time.time()
    for g, ((world, device), idx) in enumerate(groups.items()):
        logger.info("group %d/%d: W=%d %s, %d configurations (%d of %d done, %.0f s so far)", g + 1, len(groups),
                    world, device, len(idx), done, len(workloads), time.time() - t0)
        raw = run_group([workloads[i] for i in idx], timeout=1800)
        for i, r in zip(idx, raw):
            out[i] = summarize(workloads[i], r)
        done += len(idx)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    for m in ("tiny", "quick", "headline"):
        g.add_argument(f"--{m}", dest="mode", action="store_const", const=m)
    g.add_argument("--ci", dest="mode", action="store_const", const="tiny", help="same as --tiny")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"results folder (default: ./{DEFAULT_OUT}; the committed ones: --out benchmarks/results)")
    p.add_argument("--no-simulate", action="store_true", help="skip the large-cluster projection")
    o = p.add_argument_group("overrides", "set a field in every configuration of the mode "
                                          "(several values: every configuration at each)")
    o.add_argument("--world", type=_field(int, "world"), nargs="+", metavar="W", help="ranks (>= 2)")
    o.add_argument("--batch", type=_field(int, "batch_per_rank"), metavar="B", help="samples per rank per step")
    o.add_argument("--rows-cap", type=_field(int, "rows_cap"), metavar="N",
                   help="cap on rows per table (Criteo-Kaggle cardinalities)")
    o.add_argument("--dim", type=_field(int, "dim"), metavar="D", help="embedding dim (a multiple of 8)")
    o.add_argument("--alpha", type=_field(float, "alpha"), nargs="+", metavar="A",
                   help="Zipf exponent of the ids (0: uniform)")
    hot = o.add_mutually_exclusive_group()
    hot.add_argument("--multi-hot", dest="multi_hot", action="store_const", const=True,
                     help="MLPerf DLRMv2 multi-hot bag sizes")
    hot.add_argument("--one-hot", dest="multi_hot", action="store_const", const=False, help="one id per feature")
    o.add_argument("--model", choices=["ebc", "dlrm"], nargs="+", help="EBC + loss, or a full DLRM")
    o.add_argument("--hot-rows", type=_field(int, "hot_rows"), metavar="H",
                   help="hot rows of the hybrid, over all tables (the hot-row sweep still varies it)")
    o.add_argument("--steps", type=_field(int, "steps"), metavar="S", help="timed steps per model")
    o.add_argument("--warmup", type=_field(int, "warmup"), metavar="S", help="untimed steps per model first")
    return p


FLAG_FIELDS = {"world": "world", "batch": "batch_per_rank", "rows_cap": "rows_cap", "dim": "dim",
               "alpha": "alpha", "multi_hot": "multi_hot", "model": "model", "hot_rows": "hot_rows",
               "steps": "steps", "warmup": "warmup"}


def _field(kind, field: str):
    """argparse type for a Workload field: parsed by `kind`, checked by config.check_override,
    so argparse reports ``argument --flag: <field> must be ..., got <value>``."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{field} must be {kind.__name__}, got {text!r}") from None
        try:
            check_override(field, v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return v

    parse.__name__ = field
    return parse


def overrides_of(args: argparse.Namespace) -> Dict[str, object]:
    """The Workload fields the command line sets."""
    return {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items() if getattr(args, flag) is not None}


def plan_run(mode: str, overrides: Dict[str, object], cuda: bool = False):
    """(main configurations, hot-row sweep) of a mode with the overrides applied."""
    main_w = apply_overrides(mode_workloads(mode, cuda=cuda), overrides)
    sweep_w = apply_overrides(hot_row_sweep(mode), sweep_overrides(overrides))
    return main_w, sweep_w


def _reference(results: List[Dict], sweep: List[Dict]) -> Dict:
    """The multi-type result of the sweep's base workload (its table_wise line)."""
    if not sweep:
        return None
    base = sweep[0]["workload"]["name"].rsplit("-H", 1)[0]
    for r in results:
        if r["workload"]["name"].rsplit("-H", 1)[0] == base and len(r["workload"]["types"]) > 1:
            return r
    return None


def main(argv=None) -> Dict:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.no_simulate and a.mode in ("tiny", "headline"):
        parser.error(f"--no-simulate: the {a.mode} mode runs no projection (only --quick and the full run do)")
    if a.mode == "headline":  # its report is one configuration's: several values would measure and drop the rest
        several = [(flag, getattr(a, flag)) for flag in FLAG_FIELDS
                   if isinstance(getattr(a, flag), (list, tuple)) and len(getattr(a, flag)) > 1]
        if several:
            flag, values = several[0]
            parser.error(f"--headline measures one configuration; --{flag.replace('_', '-')} got several values "
                         f"{list(values)}: run --headline once per value")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`: no orphaned ranks
    mode = a.mode or "full"
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    cuda = _cuda()
    overrides = overrides_of(a)
    main_w, sweep_w = plan_run(mode, overrides, cuda=cuda)
    logger.info("%s run: %d configurations + %d in the hot-row sweep%s; writing to %s", mode, len(main_w),
                len(sweep_w), f", overrides {overrides}" if overrides else "", os.path.abspath(a.out))
    res = measure(main_w + sweep_w)
    results, sweep = res[:len(main_w)], res[len(main_w):]

    from benchmarks import report

    files = _plots(mode, results, sweep, a.out)
    title = f"Benchmarks ({mode} run" + (f", overrides {overrides})" if overrides else ")")
    md = report.markdown(results + sweep, title)
    if mode in ("quick", "full") and not a.no_simulate:
        md += "\n" + _projection(mode, a.out, files)
    doc = _document(mode, overrides, time.time() - t0, cuda, results, sweep, files)
    headline = [r for r in results if r["workload"] == HEADLINE.as_dict()]  # every field, not just the name
    if mode == "headline":  # its one configuration, overrides and all (they are recorded beside it)
        headline = results[:1]
    if headline:
        doc["headline"] = _headline(headline[0])
        if mode == "headline" and overrides:
            doc["headline"]["overrides"] = overrides
    _write(a.out, mode, doc, md)
    if headline:
        print(json.dumps(doc["headline"], indent=1))
    return doc


def _plots(mode: str, results: List[Dict], sweep: List[Dict], out: str) -> Dict[str, str]:
    """The sweep plots (bytes vs alpha, bytes vs hot rows) of every mode but the headline; their paths by name."""
    from benchmarks import plots

    files = {}
    if mode != "headline":
        files["bytes_vs_alpha"] = plots.bytes_vs_alpha(results, os.path.join(out, f"{mode}_bytes_vs_alpha.png"))
        files["bytes_vs_hot_rows"] = plots.bytes_vs_hot_rows(
            sweep, _reference(results, sweep), os.path.join(out, f"{mode}_bytes_vs_hot_rows.png"))
    return files


def _projection(mode: str, out: str, files: Dict[str, str]) -> str:
    """Project the bytes to large W (benchmarks.simulate), write its plot and projected.json, add the plot to
    ``files``; its markdown section."""
    from benchmarks import simulate

    sim = simulate.simulate(samples=500_000 if mode == "quick" else 2_000_000)
    simulate.plot(sim, os.path.join(out, "projected_bytes_vs_W.png"))
    with open(os.path.join(out, "projected.json"), "w") as f:
        json.dump(sim, f, indent=1)
    md = simulate.markdown(sim)
    files["projected_bytes_vs_W"] = os.path.join(out, "projected_bytes_vs_W.png")
    return md


def _document(mode: str, overrides: Dict[str, object], runtime_s: float, cuda: bool, results: List[Dict],
              sweep: List[Dict], files: Dict[str, str]) -> Dict:
    """The run's JSON document: what ran, on what machine, what each measure means, and the results."""
    return {
        "mode": mode, "subset": SUBSETS[mode], "overrides": overrides, "runtime_s": runtime_s,
        "machine": {"cpus": os.cpu_count(), "cuda": cuda, "python": platform.python_version(),
                    "platform": platform.platform()},
        "definitions": {
            "bytes": "OS-level bytes written by each rank during its step (/proc/self/io wchar; gloo "
                     "socket writes), mean over timed steps then over ranks; nothing logs inside a window",
            "expected_bytes": "torchrec_hybrid.planner.cost_model for the same plan (benchmarks/estimate.py)",
            "step_time": "per step the slowest rank's wall time; all types built in one process group, "
                         "timed interleaved, per step in the next order of a Williams design (every model in "
                         "every position and after every other model equally often), after warm-up, barrier before "
                         "each step (outside the window)",
            "peak_mem": "RSS (not tracemalloc): growth while building + peak growth within one step "
                        "(VmHWM reset by /proc/self/clear_refs after malloc_trim), max over ranks",
        },
        "targets": TARGETS, "configurations": results, "hot_row_sweep": sweep, "files": files,
    }


def _write(out: str, mode: str, doc: Dict, md: str) -> None:
    """Write ``<mode>.json`` and ``<mode>.md`` (``headline.*`` for the headline mode) to ``out``."""
    name = "headline" if mode == "headline" else mode
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    logger.info("wrote %s/%s.json and .md in %.0f s", out, name, doc["runtime_s"])


def _headline(r: Dict) -> Dict:
    res, rt = r["results"], r["ratios"]
    h, tw = res["frequency_hybrid"], res["table_wise"]
    fastest = res[rt["fastest_stock_type"]]
    return {
        "configuration": r["workload"]["name"], "hot_set": r["hot_set"],
        "bytes_hybrid_over_table_wise": rt["bytes_hybrid_over_table_wise"],
        "bytes_target": TARGETS["bytes_hybrid_over_table_wise"],
        "bytes_per_rank_per_step": {"frequency_hybrid": h["bytes_per_rank_per_step"],
                                    "table_wise": tw["bytes_per_rank_per_step"],
                                    "frequency_hybrid_model": h["expected_bytes_per_rank_per_step"]},
        "time_hybrid_over_fastest_stock": rt["time_hybrid_over_fastest_stock"],
        "time_target": TARGETS["time_hybrid_over_fastest_stock"],
        "fastest_stock_type": rt["fastest_stock_type"],
        "median_step_s": {"frequency_hybrid": h["step_time_s"]["median"],
                          rt["fastest_stock_type"]: fastest["step_time_s"]["median"]},
        "timed_steps": h["step_time_s"]["n"],
        "meets_bytes_target": rt["bytes_hybrid_over_table_wise"] <= TARGETS["bytes_hybrid_over_table_wise"],
        "meets_time_target": rt["time_hybrid_over_fastest_stock"] <= TARGETS["time_hybrid_over_fastest_stock"],
        "planners": rt.get("planners", {}),
    }


if __name__ == "__main__":
    main()
