"""Run a function on W gloo ranks (spawned processes on loopback) with a hard timeout.

Each test gets a free port; a rank that raises fails the test with its traceback; a rank
that hangs fails it after ``timeout`` seconds instead of hanging CI.
"""

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, kwargs, queue):
    import datetime
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, timeout: float = 240, **kwargs):
    """Runs ``fn(rank, world, **kwargs)`` on ``world`` processes; returns results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world, port, kwargs, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    import time

    deadline = time.time() + timeout
    results, errors = {}, {}
    while len(results) + len(errors) < world and time.time() < deadline:
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, status, payload = queue.get()
        (results if status == "ok" else errors)[rank] = payload
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.time()) + 5)
        if p.is_alive():
            p.kill()
    if errors:
        # the root cause is usually the one rank that did not fail in a collective
        ordered = sorted(errors, key=lambda r: ("Connection reset" in errors[r] or "Connection closed" in errors[r], r))
        raise AssertionError("\n".join(f"rank {r} failed:\n{errors[r]}" for r in ordered))
    missing = [r for r in range(world) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} hung or died (timeout {timeout}s)")
    return [results[r] for r in range(world)]
