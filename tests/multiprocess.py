"""``run_ranks``: a function's return value from each of W gloo ranks on loopback.

A thin layer over :func:`torchrec_hybrid.spawn.spawn_ranks` (free port per call, hard
timeout, every rank's traceback on failure) for tests whose ranks return one result.
"""

from torchrec_hybrid.spawn import spawn_ranks


def _returning(rank, world, emit, target, kwargs):
    emit(target(rank, world, **kwargs))


def run_ranks(fn, world: int, timeout: float = 240, **kwargs):
    """Runs ``fn(rank, world, **kwargs)`` on ``world`` processes; returns results by rank."""
    per_rank = spawn_ranks(_returning, world, timeout=timeout, target=fn, kwargs=kwargs)
    return [items[0] for items in per_rank]
