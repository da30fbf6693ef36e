"""Spawns W gloo ranks on loopback that measure a list of workloads in one process group.

One process group per world size amortises the start-up (imports, rendezvous) over all its
workloads. Each rank runs ``measure.run_workload`` per workload and sends its raw numbers
to the parent; a rank that fails or hangs fails the run with its traceback / a timeout.
Workers get ``cores // W`` torch threads each (no oversubscription on a small box).
"""

import logging
import os
from typing import Dict, List

from benchmarks.config import Workload
from benchmarks.malloc import spawn_ranks


def _worker(rank: int, world: int, emit, workloads: List[Workload], progress: bool) -> None:
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
    """Measures workloads (all of one world size and device); returns [workload][rank] results."""
    world = workloads[0].world
    assert all(w.world == world and w.device == workloads[0].device for w in workloads)
    backend = "nccl" if workloads[0].device == "cuda" else "gloo"
    per_rank = spawn_ranks(_worker, world, expected=len(workloads), timeout=timeout, backend=backend,
                           pg_timeout_s=300, workloads=workloads, progress=progress)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(workloads))]
