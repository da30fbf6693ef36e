"""Regenerates the DLRM example's README figures: the default config under each planner.

    .venv/bin/python -m examples.dlrm.results            # writes examples/dlrm/results/default_w2.json
    .venv/bin/python -m examples.dlrm.results --out /tmp/r.json --set train.steps=100
    .venv/bin/python -m examples.dlrm.results --network 2gbit --config configs/dlrm_mlperf.yaml --out /tmp/m.json

Runs ``train.py`` under torchrun (2 ranks, gloo on CPU) once per planner - ``hybrid`` (the
config's prices: this device's), ``hybrid-network`` (the hybrid planner priced for a
network-bound cluster) and ``stock`` by default - one after the other, or ``--repeats N``
rounds, the planners alternating with the order rotated each round, so a busy machine slows
them alike - every run with glibc's malloc thresholds fixed unless ``--malloc default``
(``benchmarks/malloc.py``: no page faults from blocks going back to the kernel between steps,
which a GPU's caching allocator never has) - and stores each planner's median run (by samples/s; its
final JSON line, wall time with start-up, command) and every run's samples/s, plus the
commit. ``examples/dlrm/README.md`` quotes this file; the test
``tests/examples/test_dlrm_readme.py`` fails when a quoted figure drifts from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from statistics import median
from typing import Any, Dict, List, Optional, Tuple

from benchmarks import malloc, shaped_loopback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO, "examples", "dlrm", "results", "default_w2.json")
logger = logging.getLogger("examples.dlrm.results")


# what each row of the table runs: train.py's --planner, plus the overrides that make the row
# (hybrid-network: the hybrid planner priced for a network-bound cluster on any device)
PLANNERS: Dict[str, Tuple[str, List[str]]] = {
    "hybrid": ("hybrid", []),
    "hybrid-network": ("hybrid", ["sharding.hot_set.compute_costs=network"]),
    "stock": ("stock", []),
    "manual": ("manual", []),
}


def command(planner: str, config: str, nproc: int, overrides: List[str]) -> List[str]:
    """The torchrun command line of one run of row ``planner`` (the user's overrides last)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    train_planner, own = PLANNERS[planner]
    cmd = [torchrun, "--nproc_per_node", str(nproc), "examples/dlrm/train.py", "--config", config,
           "--planner", train_planner, "--set", "train.progress_bar=false"]
    for o in own + overrides:
        cmd += ["--set", o]
    return cmd


def run_once(planner: str, config: str, nproc: int, overrides: List[str], timeout: float,
             allocator: str = malloc.DEFAULT_MODE) -> Dict[str, Any]:
    cmd = command(planner, config, nproc, overrides)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=malloc.child_env(allocator))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"planner {planner}: train.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if len(lines) != 1:
        raise RuntimeError(f"planner {planner}: expected one JSON line, got {lines!r}")
    plan = [ln.split("plan: ", 1)[1] for ln in proc.stderr.splitlines() if " plan: " in ln]
    return {"result": json.loads(lines[0]), "wall_s": round(wall, 1), "plan_table": plan,
            "command": " ".join(cmd[1:])}


README = os.path.join(REPO, "examples", "dlrm", "README.md")
START, END = "<!-- results table: python -m examples.dlrm.results --readme -->", "<!-- end results table -->"


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def readme_table(results: Dict[str, Any]) -> str:
    """The README's comparison table, rendered from a results file."""
    rows = ["| planner | plan | hot rows | embedding bytes / rank / step | final loss | AUC | NE "
            "| validation AUC / NE | samples/s | vs stock (per round) | wall |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for planner, run in results["runs"].items():
        r = run["result"]
        types: Dict[str, int] = {}
        for line in run.get("plan_table", [])[1:]:
            parts = line.split()
            if len(parts) > 1 and parts[0].startswith("t_"):
                types[parts[1]] = types.get(parts[1], 0) + 1
        plan = " + ".join(f"{n} {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))
        rows.append(f"| {planner} | {plan} | {r.get('hot_rows', 0):,} | {_fmt(r.get('bytes_per_step'), ',.0f')} "
                    f"| {_fmt(r.get('loss'), '.4f')} | {_fmt(r.get('auc'), '.4f')} | {_fmt(r.get('ne'), '.4f')} "
                    f"| {_fmt(r.get('val_auc'), '.4f')} / {_fmt(r.get('val_ne'), '.4f')} "
                    f"| {_speed(r, results.get('repeats', {}).get(planner))} "
                    f"| {_versus_stock(results, planner)} | {run['wall_s']:.0f} s |")
    return "\n".join(rows)


def _versus_stock(results: Dict[str, Any], planner: str) -> str:
    """This row's samples/s over the stock row's: the medians', then round by round (each
    round runs every planner once, so a round's ratio compares runs made close in time)."""
    repeats = results.get("repeats", {})
    mine, stock = repeats.get(planner), repeats.get("stock")
    if planner == "stock" or not mine or not stock:
        return "-"
    rounds = ", ".join(f"{a / b:.2f}x" for a, b in zip(mine, stock))
    return f"{median(mine) / median(stock):.2f}x ({rounds})"


def _speed(result: Dict[str, Any], repeats: Optional[List[float]]) -> str:
    """samples/s of the quoted run; with repeats, the median and the range of the runs."""
    if not repeats or len(repeats) < 2:
        return _fmt(result.get("samples_per_s"), ",.0f")
    return f"{_fmt(median(repeats), ',.0f')} (median of {len(repeats)}: {min(repeats):,.0f}-{max(repeats):,.0f})"


def run_rounds(planners: List[str], repeats: int, run) -> Dict[str, List[Dict[str, Any]]]:
    """``repeats`` rounds of ``run(planner)``, the planners' order rotated each round."""
    out: Dict[str, List[Dict[str, Any]]] = {p: [] for p in planners}
    for i in range(repeats):
        for planner in planners[i % len(planners):] + planners[:i % len(planners)]:
            logger.info("round %d/%d: planner %s ...", i + 1, repeats, planner)
            out[planner].append(run(planner))
            logger.info("planner %s: %s (%.0f s wall)", planner, out[planner][-1]["result"],
                        out[planner][-1]["wall_s"])
    return out


def write_readme(results: Dict[str, Any], path: str = README) -> None:
    with open(path) as f:
        text = f.read()
    if START not in text or END not in text:
        raise ValueError(f"{path}: no results table markers ({START!r} ... {END!r})")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{readme_table(results)}\n{END}{tail}")


def commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/dlrm.yaml")
    p.add_argument("--planners", nargs="+", default=["hybrid", "hybrid-network", "stock"], choices=list(PLANNERS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--repeats", type=int, default=1, help="rounds of all planners, alternating (default 1)")
    p.add_argument("--malloc", choices=malloc.MODES, default=malloc.DEFAULT_MODE,
                   help="the runs' C allocator: glibc's malloc thresholds fixed (default) or its defaults "
                        "(benchmarks/malloc.py)")
    p.add_argument("--readme", action="store_true",
                   help="only re-render the README table from --out (no runs)")
    p.add_argument("--network", default=shaped_loopback.UNSHAPED, metavar="RATE",
                   help="run the ranks on a loopback shaped to RATE (as tc spells it: 2gbit; benchmarks/"
                        "shaped_loopback.py: bytes then cost time), or unshaped (default)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rate = shaped_loopback.parse_rate("--network", args.network)
    except ValueError as e:
        p.error(str(e))
    if rate != shaped_loopback.UNSHAPED and shaped_loopback.current_rate() is None:  # re-run in the namespace
        try:
            shaped_loopback.check_available("--network", rate)
        except shaped_loopback.ShapingUnavailable as e:
            p.exit(2, f"{e}\n")
        raise SystemExit(shaped_loopback.run_module(rate, "examples.dlrm.results",
                                                    sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.readme:
        with open(args.out) as f:
            write_readme(json.load(f))
        logger.info("re-rendered the table in %s from %s", README, args.out)
        return
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    rounds = run_rounds(args.planners, args.repeats,
                        lambda planner: run_once(planner, args.config, args.nproc, args.overrides, args.timeout,
                                                 args.malloc))
    speeds = {p: [r["result"]["samples_per_s"] for r in rs] for p, rs in rounds.items()}
    runs = {p: sorted(rs, key=lambda r: r["result"]["samples_per_s"])[(len(rs) - 1) // 2] for p, rs in rounds.items()}
    out = {"config": args.config, "overrides": args.overrides, "nproc": args.nproc,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(),
           "cpu_count": os.cpu_count(), "allocator": malloc.describe(args.malloc), "network": rate,
           "runs": runs, "repeats": speeds}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    logger.info("wrote %s", args.out)
    if os.path.abspath(args.out) == os.path.abspath(DEFAULT_OUT):
        write_readme(out)
        logger.info("re-rendered the table in %s", README)


if __name__ == "__main__":
    main()
