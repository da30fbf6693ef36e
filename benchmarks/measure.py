"""Per-rank measurement of one workload: every sharding type in one process group.

Protocol (docs/results.md, "How it is measured"):
- all models of the workload are built in the same process group, run ``warmup`` untimed
  steps each, then ``steps`` timed steps *interleaved*: step s runs every model once, in
  the order of row s of a Williams design (:func:`balanced_orders`: rotations of one
  sequence chosen so that over a cycle every model runs in every position and right after
  every other model equally often), each behind a barrier (outside the window). A plain
  rotation keeps each model behind the same predecessor, and the predecessor moves a step
  time by up to ~10% here (caches, allocator): the identical table_wise plan measured 11%
  slower as "planner", which always ran right after data_parallel;
- bytes: OS-level ``wchar`` (what gloo writes to its sockets) around each model's step;
  nothing prints, logs or writes files inside a window;
- memory (after timing, so it cannot disturb it): RSS growth while building the model,
  plus the peak RSS above the pre-step RSS over one step, with the kernel's high-water mark
  reset through ``/proc/self/clear_refs`` before the step, and freed heap pages handed back
  to the kernel first (glibc ``malloc_trim``) so that the step's allocations show in RSS
  instead of reusing pages other models freed; ``ru_maxrss`` of the whole process is
  reported too;
- the allocator: the ranks run with glibc's malloc thresholds fixed (``benchmarks/malloc.py``,
  set before this runs); each step's minor page faults are counted.
"""

import gc
import logging
import math
import resource
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from torchrec_hybrid.comm_bytes import sent_bytes

from benchmarks.config import Workload
from benchmarks.data import make_data
from benchmarks.malloc import current as allocator
from benchmarks.malloc import faults_between, minor_faults, release_freed_memory
from benchmarks.models import build

logger = logging.getLogger(__name__)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss() -> int:
    return _status_kb("VmRSS") * 1024


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak() -> int:
    return _status_kb("VmHWM") * 1024


def balanced_orders(n: int) -> List[List[int]]:
    """A Williams design for ``n`` models: ``n`` orders (``2n`` for odd ``n``).

    Row s is the base sequence 0, 1, n-1, 2, n-2, ... shifted by s (mod n); for odd n the
    reversed rows follow. Over all rows each model takes each position equally often and
    each ordered pair (a right before b, a != b) occurs equally often.
    """
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(x + s) % n for x in base] for s in range(n)]
    return rows if n % 2 == 0 else rows + [r[::-1] for r in rows]


def median_ci(xs: List[float]) -> List[float]:
    """``[low, median, high]``: the median of ``xs`` and a distribution-free confidence interval
    for it of at least 95%: the order statistics ``s[k]`` and ``s[n - 1 - k]`` of the sorted
    values, ``k`` the largest with P(Binomial(n, 1/2) <= k) <= 0.025 (the chance that ``s[k]``
    lies above the true median); for fewer than 6 values no such ``k`` exists and the interval
    is the whole range (93.75% at 5 values)."""
    if not xs:
        raise ValueError("median_ci: no values")
    s, n = sorted(xs), len(xs)
    k, below = 0, 0
    for i in range(n // 2):  # exact integers: n/2 terms at most, once per result
        below += math.comb(n, i)
        if below * 40 > 2 ** n:  # P(X <= i) > 0.025
            break
        k = i
    return [s[k], statistics.median(s), s[n - 1 - k]]


def ci_text(ci: List[float]) -> str:
    """``[low, median, high]`` (:func:`median_ci`) as the reports print a ratio's: ``1.02x [0.98, 1.05]``."""
    return f"{ci[1]:.2f}x [{ci[0]:.2f}, {ci[2]:.2f}]"


def paired_text(ratios: Dict[str, Any]) -> str:
    """A plan's paired step ratio (its ``ratios`` entry) as the reports print it: the pooled median and its
    interval, and with several runs the range of their own medians (``0.81x [0.79, 0.85] (runs 0.80-0.85)``);
    "-" for results older than the paired ratio."""
    if not ratios.get("paired_step_ci"):
        return "-"
    runs = ratios.get("paired_step_runs", [])
    spread = f" (runs {min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
    return ci_text(ratios["paired_step_ci"]) + spread


def slowest_rank(per_rank: List[List[float]]) -> List[float]:
    """Per step, the slowest rank's time (``per_rank``: each rank's times, step by step): a collective
    step is as slow as its slowest rank."""
    return [max(step) for step in zip(*per_rank)]


def run_workload(rank: int, world: int, w: Workload) -> Dict:
    """Measures workload `w` on this rank; returns raw per-step numbers per sharding type."""
    device = torch.device("cuda", rank) if w.device == "cuda" else torch.device("cpu")
    data = make_data(w, rank, world)
    built, build_rss, types, dense, estimates = {}, {}, {}, 0, {}
    for kind in w.types:
        gc.collect()
        before = rss()
        b = build(kind, w, data.tables, data.hot_ids, device, stats=data.stats)
        built[kind], build_rss[kind], types[kind], dense = b, rss() - before, b.table_types, b.dense_numel
        if b.planner_bytes is not None:
            estimates[kind] = b.planner_bytes
    kinds = list(w.types)
    for s in range(w.warmup):
        for kind in kinds:
            built[kind].step(data.batches[s])
    times: Dict[str, List[float]] = {k: [] for k in kinds}
    sent: Dict[str, List[int]] = {k: [] for k in kinds}
    faults: Dict[str, List[Optional[int]]] = {k: [] for k in kinds}
    orders = balanced_orders(len(kinds))
    for s in range(w.steps):
        batch = data.batches[w.warmup + s]
        for kind in (kinds[i] for i in orders[s % len(orders)]):
            dist.barrier()
            step = built[kind].step
            f0, b0, t0 = minor_faults(), sent_bytes(), time.perf_counter()
            step(batch)
            t1, b1, f1 = time.perf_counter(), sent_bytes(), minor_faults()
            times[kind].append(t1 - t0)
            sent[kind].append(b1 - b0)
            faults[kind].append(faults_between(f0, f1))
    step_peak = {}
    for kind in kinds:
        dist.barrier()
        gc.collect()
        release_freed_memory()
        base, ok = rss(), reset_peak()
        built[kind].step(data.batches[-1])
        step_peak[kind] = max(0, peak() - base) if ok else None
    del built
    gc.collect()
    dist.barrier()
    return {
        "rank": rank, "times_s": times, "sent_bytes": sent, "page_faults": faults, "allocator": allocator(),
        "build_rss_bytes": build_rss,
        "step_peak_rss_bytes": step_peak, "table_types": types, "dense_numel": dense,
        "planner_estimates": estimates,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cold_fraction": data.cold_fraction(), "hotness": data.hotness,
        "hot_rows_per_table": {k: int(v.numel()) for k, v in data.hot_ids.items()},
        "rows_per_table": {t.name: t.num_embeddings for t in data.tables},
    }
