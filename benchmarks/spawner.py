"""Starts a benchmark's W gloo ranks on loopback, each with its C allocator set before anything else.

:func:`spawn_ranks` is ``torchrec_hybrid.spawn.spawn_ranks`` (one process per rank, one process group, every
rank's results sent back to the parent; a rank that fails or hangs fails the run with its traceback / a
timeout) with each rank's malloc thresholds set first (``malloc.set_allocator``: every benchmark's ranks run
with them fixed unless asked otherwise). :func:`run_group` is the main sweep's (``python -m benchmarks``): one
process group per world size, whose ranks run ``measure.run_workload`` for each of its workloads in turn, which
amortises the start-up (imports, rendezvous) over them; its workers get ``cores // W`` torch threads each (no
oversubscription on a small box).
"""

import logging
import os
from typing import Any, Callable, Dict, List

from benchmarks import malloc as allocator
from benchmarks.config import Workload
from torchrec_hybrid import spawn


def _rank(rank: int, world: int, emit: Callable, _fn: Callable, _malloc: str, **kwargs: Any) -> None:
    allocator.set_allocator(_malloc)
    _fn(rank, world, emit, **kwargs)


def spawn_ranks(fn: Callable, world: int, *, malloc: str = allocator.DEFAULT_MODE, **kwargs: Any) -> List[List[Any]]:
    """``torchrec_hybrid.spawn.spawn_ranks`` with every rank's allocator set first (``malloc.set_allocator``)."""
    return spawn.spawn_ranks(_rank, world, _fn=fn, _malloc=allocator.check_mode(malloc), **kwargs)


def _sweep_worker(rank: int, world: int, emit, workloads: List[Workload], progress: bool) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrec_hybrid").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from benchmarks.measure import run_workload

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread writing inside a measured window
        bar = tqdm(total=len(workloads), desc=f"W={world}", unit="config")
    for w in workloads:
        emit(run_workload(rank, world, w))
        if bar is not None:
            bar.set_postfix_str(w.name)
            bar.update()
    if bar is not None:
        bar.close()


def run_group(workloads: List[Workload], timeout: float = 900, progress: bool = True) -> List[List[Dict]]:
    """Measures workloads (all of one world size and device) in one process group; returns [workload][rank]
    results."""
    world = workloads[0].world
    assert all(w.world == world and w.device == workloads[0].device for w in workloads)
    backend = "nccl" if workloads[0].device == "cuda" else "gloo"
    per_rank = spawn_ranks(_sweep_worker, world, expected=len(workloads), timeout=timeout, backend=backend,
                           pg_timeout_s=300, workloads=workloads, progress=progress)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(workloads))]
