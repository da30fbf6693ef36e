"""Runs a function on W ranks spawned on loopback, with a deadline (tests, benchmarks).

Each rank joins a process group on a free port and calls ``fn(rank, world, emit, **kwargs)``;
everything it passes to ``emit`` reaches the parent. A rank that raises fails the run with
its traceback, and a rank that hangs fails it at the deadline: nothing waits forever. For
real jobs use torchrun (see ``examples/dlrm``); this is for many short runs in one process.

Gloo ranks start from a fork server that has imported torch, TorchRec, FBGEMM and this package
once (about 5 s of CPU per rank otherwise); each rank gets the caller's environment as it is
at the call, except what those imports read from it (e.g. ``OMP_NUM_THREADS``: the server's,
as at its start; set threads with ``torch.set_num_threads`` in the rank). NCCL ranks, and every
rank on a machine with CUDA, are spawned fresh: the server's imports can initialise CUDA
and a forked child of a process with CUDA state cannot use CUDA.
"""

import datetime
import logging
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A spawned rank raised, or did not report in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once in the fork server: what every rank function needs, and the slow part of a start
_PRELOAD = ["torch.distributed", "fbgemm_gpu", "torchrec", "torchrec.distributed", "torchrec_hybrid"]


def _context(backend: str):
    if backend == "nccl" or torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first call)
    return ctx


def _entry(rank: int, fn: Callable, world: int, port: int, backend: str, pg_timeout_s: float,
           kwargs: dict, queue, environ: dict) -> None:
    os.environ.clear()  # a forked rank would otherwise see the fork server's environment
    os.environ.update(environ)
    warnings.filterwarnings("ignore")
    for name in ("torchrec", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        fn(rank, world, lambda item: queue.put((rank, "ok", item)), **kwargs)
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure(errors: dict) -> RankFailure:
    # the root cause is usually the one rank that did not fail inside a collective
    def secondary(r: int) -> bool:
        return "Connection reset" in errors[r] or "Connection closed" in errors[r]

    ranks = sorted(errors, key=lambda r: (secondary(r), r))
    return RankFailure("\n".join(f"rank {r} failed:\n{errors[r]}" for r in ranks))


def spawn_ranks(fn: Callable, world: int, *, expected: int = 1, timeout: float = 240,
                backend: str = "gloo", pg_timeout_s: float = 60, **kwargs: Any) -> List[List[Any]]:
    """Runs ``fn`` on ``world`` spawned ranks; returns each rank's ``expected`` emitted items.

    ``fn`` must be importable (spawn pickles it by name). Raises :class:`RankFailure` if a
    rank raised (all tracebacks) or if items are still missing after ``timeout`` seconds.
    """
    ctx = _context(backend)
    queue = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, fn, world, port, backend, pg_timeout_s, kwargs, queue, environ),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: List[List[Any]] = [[] for _ in range(world)]
    errors = {}
    pending, deadline = expected * world, time.time() + timeout
    try:
        while pending and time.time() < deadline:
            if queue.empty():
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                time.sleep(0.05)
                continue
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank].append(payload)
                pending -= 1
            else:
                errors[rank] = payload
                pending -= expected - len(results[rank])
    finally:
        for p in procs:  # a failed run waits 5 s per rank; a good one until its deadline
            p.join(timeout=5 if errors else max(0.0, deadline - time.time()) + 5)
            if p.is_alive():
                p.kill()
    if errors:
        raise _failure(errors)
    missing = [r for r in range(world) if len(results[r]) < expected]
    if missing:
        raise RankFailure(f"ranks {missing} hung or died (timeout {timeout}s)")
    return results
