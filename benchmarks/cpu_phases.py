"""Where each plan's CPU goes per step: the hybrid's phases against TorchRec's plan, per rank.

On these CPU boxes a step costs what its ranks compute (4 gloo ranks share 2 cores and the
loopback "network" is a memory copy), so the product benchmark's step ratio follows CPU time.
This benchmark attributes it. The network-priced hybrid plan and TorchRec's planner's plan
(``benchmarks/product.py``: same tables, statistics and batches) train one step each per round,
in alternating order behind a barrier. Per step and rank it takes the main thread's CPU time
(``time.thread_time``: the rank's own compute; gloo's threads do the copies) of the forward
call, the output wait and the backward, the process's CPU time, and, inside the hybrid's step,
the CPU time of each of its phases (timers around our own functions, :data:`PHASES`). The same
two plans (planned for the workload's batch) train at that batch and at a tiny one (B=8, by
default): what the hybrid spends at the tiny batch is fixed per step (ops dispatched, Python,
kernel calls), the rest grows with the ids.

    python -m benchmarks.cpu_phases                            # W=4, multihot, B=512 and 8, ~1 min
    python -m benchmarks.cpu_phases --out benchmarks/results   # the committed run
    python -m benchmarks.cpu_phases --workload onehot --out benchmarks/results   # -> cpu_phases_onehot.*
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import statistics
import time
from collections import defaultdict
from typing import Any, Dict, Iterator, List

import torch

from benchmarks.product import WORKLOADS, plan_models, plan_types, types_text, workload_data
from benchmarks.report import write_results
from benchmarks import malloc

logger = logging.getLogger(__name__)

PLANS = ("hybrid_planner_bytes", "stock_planner")
PARTS = ("forward call", "output wait", "backward")
# the hybrid's phases: (label, module, class or None for a module function, attribute); timed
# inclusively, so a phase holds what it calls (none of these calls another of them)
PHASES = (
    ("id check", "torchrec_hybrid.sharded_ebc", "HybridShardedEmbeddingBagCollection", "_start_id_check"),
    ("route ids (key map gather)", "torchrec_hybrid.sharding.input_dist", "HybridSparseFeaturesDist", "_route"),
    ("bucketize by owner", "torchrec_hybrid.sharding.input_dist", "HybridSparseFeaturesDist", "_bucketize"),
    ("pack non-empty cold bags", "torchrec_hybrid.sharding.input_dist", "HybridSparseFeaturesDist",
     "_nonempty_bags"),
    ("cold id exchange: send", "torchrec_hybrid.sharding.cold_all_to_all", "ColdIdsAllToAll", "__call__"),
    ("cold id exchange: split sizes, receive", "torchrec_hybrid.sharding.cold_all_to_all", "ColdIdsAllToAll",
     "_received"),
    ("owner's lane inputs", "torchrec_hybrid.sharding.cold_all_to_all", "ColdBags", "lane_inputs"),
    ("cold TBE forward (TorchRec lookup)", "torchrec_hybrid._compat", None, "grouped_lookup_forward"),
    ("output dist forward (pack, send)", "torchrec_hybrid.sharding.output_dist", "HybridPooledEmbeddingDist",
     "forward"),
    ("receive partial sums and hot rows (wait, replica)", "torchrec_hybrid.sharding.output_dist", "_AllToAllWait",
     "forward"),
    ("add partial sums to hot pooling", "torchrec_hybrid.sharding.output_dist", "_AddPartials", "forward"),
    ("backward: add partial sums", "torchrec_hybrid.sharding.output_dist", "_AddPartials", "backward"),
    ("backward: received units' gradient, send it", "torchrec_hybrid.sharding.output_dist", "_AllToAllWait",
     "backward"),
    ("backward: pack", "torchrec_hybrid.sharding.output_dist", "_Pack", "backward"),
)


@contextlib.contextmanager
def phase_timers(totals: Dict[str, float]) -> Iterator[None]:
    """While active, adds each :data:`PHASES` call's main-thread CPU seconds to ``totals[label]``;
    puts the originals back after."""
    import importlib

    undo = []
    for label, module_name, cls_name, attr in PHASES:
        owner: Any = importlib.import_module(module_name)
        if cls_name is not None:
            owner = getattr(owner, cls_name)
        raw = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_label] += time.thread_time() - t0

        timed = functools.wraps(fn)(timed)
        setattr(owner, attr, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        undo.append((owner, attr, raw))
    try:
        yield
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


def _rank_main(rank: int, world: int, emit, workload: str, batch: int, rows_cap: int, warmup: int,
               steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from benchmarks.models import training_loss

    spec = WORKLOADS[workload]  # the plans: the workload's, from statistics at its batch, whatever ``batch``
    tables, stats, _ = workload_data(spec, world, rank, rows_cap, 8, 0)
    _, plans, models = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD)
    batches = workload_data(dict(spec, batch=batch), world, rank, rows_cap, 8, warmup + steps)[2]
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    parts: Dict[str, List[List[float]]] = {n: [] for n in PLANS}
    process: Dict[str, List[float]] = {n: [] for n in PLANS}
    phases: Dict[str, List[float]] = defaultdict(list)
    for i, kjt in enumerate(batches):
        for n in (PLANS if i % 2 == 0 else PLANS[::-1]):
            totals: Dict[str, float] = defaultdict(float)
            timers = phase_timers(totals) if n == PLANS[0] else contextlib.nullcontext()
            dist.barrier()
            with timers:
                p0, t = time.process_time(), [time.thread_time()]
                out = models[n](kjt)
                t.append(time.thread_time())
                values = out.wait().values()
                t.append(time.thread_time())
                training_loss(values).backward()
                t.append(time.thread_time())
                p1 = time.process_time()
            if i >= warmup:
                parts[n].append([b - a for a, b in zip(t, t[1:])])
                process[n].append(p1 - p0)
                if n == PLANS[0]:
                    for label, *_ in PHASES:
                        phases[label].append(totals[label])
    emit({"parts": parts, "process": process, "phases": dict(phases), "allocator": malloc.current(),
          "types": {n: plan_types(plans[n]) for n in PLANS}})


def _median_ms(values: List[float]) -> float:
    return statistics.median(values) * 1e3


def run_batch(workload: str, world: int, batch: int, rows_cap: int, warmup: int, steps: int) -> Dict[str, Any]:
    """One batch size: per plan, per rank, the median main-thread CPU of each part of a step and the
    median process CPU; per hybrid phase, per rank, its median main-thread CPU (ms)."""
    outs = [items[0] for items in malloc.spawn_ranks(_rank_main, world, timeout=3000, workload=workload, batch=batch,
                                              rows_cap=rows_cap, warmup=warmup, steps=steps)]
    plans = {}
    for n in PLANS:
        per_part = {p: [_median_ms([s[j] for s in o["parts"][n]]) for o in outs] for j, p in enumerate(PARTS)}
        main = [_median_ms([sum(s) for s in o["parts"][n]]) for o in outs]
        plans[n] = {"types": outs[0]["types"][n], "main_thread_ms": per_part, "main_thread_total_ms": main,
                    "process_ms": [_median_ms(o["process"][n]) for o in outs]}
    phases = {label: [_median_ms(o["phases"][label]) for o in outs] for label, *_ in PHASES}
    return {"batch": batch, "allocator": outs[0]["allocator"], "plans": plans, "hybrid_phases_ms": phases}


def run(workload: str, world: int, batches: List[int], rows_cap: int, warmup: int, steps: int) -> Dict[str, Any]:
    runs = [run_batch(workload, world, b, rows_cap, warmup, steps) for b in batches]
    return {"workload": workload, "world": world, "rows_cap": rows_cap, "warmup": warmup, "steps": steps,
            "allocator": malloc.described(runs), "runs": runs}


def _mean_max(values: List[float]) -> str:
    return f"{statistics.fmean(values):.2f} / {max(values):.2f}"


def markdown(res: Dict[str, Any], title: bool = True) -> List[str]:
    runs = res["runs"]
    lines = [f"# CPU per step and rank: {res['workload']}, W={res['world']}, {res['steps']} alternating steps",
             ""] if title else []
    lines += ["Main-thread CPU per rank, ms (median over steps; mean over ranks / busiest rank); allocator: "
              f"{res.get('allocator', malloc.UNRECORDED)}:", "",
              "| B | plan | its types | " + " | ".join(PARTS) + " | main thread, all parts | process CPU |",
              "|---:|---|---|" + "---:|" * (len(PARTS) + 2)]
    for r in runs:
        for n, p in r["plans"].items():
            types = types_text(p["types"])
            cells = [_mean_max(p["main_thread_ms"][part]) for part in PARTS]
            lines.append(f"| {r['batch']} | {n} | {types} | " + " | ".join(cells) + f" | "
                         f"{_mean_max(p['main_thread_total_ms'])} | {_mean_max(p['process_ms'])} |")
    lines += ["", f"The {PLANS[0]} plan's phases, main-thread CPU per rank, ms (mean over ranks / busiest rank):", "",
              "| phase | " + " | ".join(f"B={r['batch']}" for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    for label, *_ in PHASES:
        lines.append(f"| {label} | " + " | ".join(_mean_max(r["hybrid_phases_ms"][label]) for r in runs) + " |")
    return lines


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workload", default="multihot", choices=list(WORKLOADS))
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="batch sizes per rank (default: the workload's and 8)")
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="out/cpu_phases")
    a = ap.parse_args(argv)
    batches = a.batches or [WORKLOADS[a.workload]["batch"], 8]
    if a.world < 2 or a.steps < 1 or a.warmup < 0 or min(batches) < 1:
        ap.error(f"--world must be >= 2, --steps >= 1, --warmup >= 0 and every batch >= 1 (got {a.world}, "
                 f"{a.steps}, {a.warmup}, {batches})")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    res = run(a.workload, a.world, batches, a.rows_cap, a.warmup, a.steps)
    name = "cpu_phases" if a.workload == "multihot" else f"cpu_phases_{a.workload}"  # the default keeps its name
    print(write_results(a.out, name, res, markdown(res)))
    return res


if __name__ == "__main__":
    main()
