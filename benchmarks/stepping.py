"""Training the plans of one benchmark side by side: each step timed behind a barrier, in balanced orders.

:func:`timed_step`: one training step of a model behind a barrier, with its wall and process CPU time, the bytes
its rank sends (``/proc/self/io``) and its minor page faults; :func:`interleaved_steps` and :func:`step_models`:
one step of every model per batch, the order of the models balanced over the steps (a Williams design,
``measure.balanced_orders``). :func:`set_threads` / :func:`add_threads_argument` / :func:`threads_text`: the
ranks' intra-op threads (``--threads N``) and how the reports say them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from benchmarks import malloc
from benchmarks.measure import balanced_orders
from benchmarks.models import training_loss
from torchrec_hybrid.comm_bytes import sent_bytes


def set_threads(threads: int) -> int:
    """A rank's intra-op threads: ``threads`` (``torch.set_num_threads``), or torch's default for 0 (not
    called: what ``mp.spawn`` without it gives); returns the count it runs with (``torch.get_num_threads``)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0: torch's default), got {threads}")
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def add_threads_argument(ap: argparse.ArgumentParser) -> None:
    """``--threads N``: each rank's intra-op threads (:func:`set_threads`; the caller refuses N < 0)."""
    ap.add_argument("--threads", type=int, default=1, metavar="N",
                    help="intra-op threads per rank (torch.set_num_threads(N); default 1, one core's work per rank; "
                         "0: torch's default, set_num_threads not called); recorded in the results")


def threads_text(results: List[Dict[str, Any]]) -> str:
    """The ranks' intra-op threads of ``results`` as the reports say them (each distinct setting once; results
    from before ``--threads`` ran one thread per rank)."""
    def one(r: Dict[str, Any]) -> str:
        t = r.get("threads", 1)
        if t == 0:
            return f"torch's default per rank ({r.get('torch_threads', '?')} here; --threads 0)"
        return f"{t} per rank (torch.set_num_threads({t}))"

    return "; ".join(dict.fromkeys(one(r) for r in results)) or "-"


def timed_step(model: Any, kjt: Any) -> Tuple[float, float, int, Optional[int]]:
    """One training step of ``model`` behind a barrier: its wall seconds, process CPU seconds, bytes sent and
    minor page faults (``malloc.minor_faults``; None where they are not counted)."""
    dist.barrier()
    f0, b0, c0, t0 = malloc.minor_faults(), sent_bytes(), time.process_time(), time.perf_counter()
    training_loss(model(kjt).wait().values()).backward()
    t1, c1, b1, f1 = time.perf_counter(), time.process_time(), sent_bytes(), malloc.minor_faults()
    return t1 - t0, c1 - c0, b1 - b0, malloc.faults_between(f0, f1)


def step_models(models: Dict[str, Any], names, kjt, i: int, timed: bool, sent: Dict[str, List[int]],
                times: Dict[str, List[float]]) -> None:
    """One training step of each of ``names``, in the order of row ``i`` of a Williams design
    (``measure.balanced_orders``: over its rows every model takes every position, and follows every other
    model, equally often; ``i``: counted from the first timed step, so the timed steps start a cycle), each
    behind a barrier; on a timed step, record each model's bytes sent and time."""
    names = tuple(names)
    orders = balanced_orders(len(names))
    for name in (names[j] for j in orders[i % len(orders)]):
        wall, _, nbytes, _ = timed_step(models[name], kjt)
        if timed:
            sent[name].append(nbytes)
            times[name].append(wall)


def interleaved_steps(models: Dict[str, Any], batches: List[Any], warmup: int,
                      order: Callable[[int], List[str]]) -> Dict[str, Dict[str, List[Any]]]:
    """One training step of each model per batch, in the order ``order(i)`` gives for batch ``i``, each
    behind a barrier; per model, over the steps after the ``warmup`` first: wall seconds, process CPU
    seconds, bytes sent and page faults (``{"wall": .., "cpu": .., "sent": .., "faults": ..}``, each
    ``{model: [per step]}``)."""
    keys = ("wall", "cpu", "sent", "faults")
    out: Dict[str, Dict[str, List[Any]]] = {k: {n: [] for n in models} for k in keys}
    for i, kjt in enumerate(batches):
        for n in order(i):
            measured = timed_step(models[n], kjt)
            if i >= warmup:
                for key, value in zip(keys, measured):
                    out[key][n].append(value)
    return out
