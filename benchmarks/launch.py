"""Spawns W gloo ranks on loopback that measure a list of workloads in one process group.

One process group per world size amortises the start-up (imports, rendezvous) over all its
workloads. Each rank runs ``measure.run_workload`` per workload and sends its raw numbers
to the parent; a rank that fails or hangs fails the run with its traceback / a timeout.
Workers get ``cores // W`` torch threads each (no oversubscription on a small box).
"""

import datetime
import logging
import os
import socket
import time
import traceback
from typing import Dict, List

import torch.multiprocessing as mp

from benchmarks.config import Workload

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, workloads: List[Workload], queue, progress: bool) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    for name in ("torchrec", "torchrec_hybrid", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    backend = "nccl" if workloads[0].device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        from benchmarks.measure import run_workload

        bar = None
        if progress and rank == 0:
            from tqdm import tqdm

            tqdm.monitor_interval = 0  # no monitor thread writing inside a measured window
            bar = tqdm(total=len(workloads), desc=f"W={world}", unit="config")
        for i, w in enumerate(workloads):
            queue.put((rank, "ok", i, run_workload(rank, world, w)))
            if bar is not None:
                bar.set_postfix_str(w.name)
                bar.update()
        if bar is not None:
            bar.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", -1, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(workloads: List[Workload], timeout: float = 900, progress: bool = True) -> List[List[Dict]]:
    """Measures workloads (all of one world size and device); returns [workload][rank] results."""
    world = workloads[0].world
    assert all(w.world == world and w.device == workloads[0].device for w in workloads)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, workloads, queue, progress), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = [[None] * world for _ in workloads]
    pending, deadline, error = len(workloads) * world, time.time() + timeout, None
    try:
        while pending and error is None and time.time() < deadline:
            if queue.empty():
                if not any(p.is_alive() for p in procs):
                    break
                time.sleep(0.05)
                continue
            rank, status, i, payload = queue.get()
            if status == "error":
                error = f"rank {rank} failed:\n{payload}"
            else:
                results[i][rank] = payload
                pending -= 1
    finally:
        for p in procs:
            p.join(timeout=5 if (error or pending) else max(1.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
    if error:
        raise RuntimeError(error)
    if pending:
        raise RuntimeError(f"{pending} rank results missing for W={world} (hang or crash; timeout {timeout}s)")
    return results
