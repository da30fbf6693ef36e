"""The C allocator the benchmarks' ranks run under, and the page faults a step costs (``spawner.py`` sets it).

PyTorch's CPU tensors come from the C library's ``malloc``. glibc's default thresholds are
*dynamic*: a large block goes back to the kernel when freed (``munmap``, or a trim of the
heap's top), and the next step's buffer of that size is then zero-filled by the kernel page
by page on first touch: minor page faults, which cost CPU time in the step. Whether a block
goes back depends on the order the heap saw sizes in, not only on the plan, so two runs of
the same plan, or two ranks of one run, can differ by thousands of faults per step
(``benchmarks/results/product_w4_glibc.md`` against ``product_w4.md``). A GPU's caching
allocator keeps its blocks, and so do jemalloc and tcmalloc on CPU: there these faults do not
exist. So every benchmark rank runs with glibc's thresholds *fixed* (:data:`FIXED`: blocks
below the mmap threshold come from the heap, whose top is not trimmed below the trim
threshold), which keeps most of a step's blocks in the process - not all: a block above the
mmap threshold (a data_parallel plan's replicated tables) is still mapped afresh, and
glibc's aligned allocations (``posix_memalign``, PyTorch's) can still miss a freed block of
their own size, so the tables count the faults that remain. ``default`` leaves glibc as it is
(what a CPU job that does not tune its allocator gets). Results files record which
(:func:`current`, from the ranks).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import statistics
from typing import Any, Iterable, List, Optional

logger = logging.getLogger(__name__)

MODES = ("fixed", "default")
DEFAULT_MODE = "fixed"
# what results files written before this module say nothing about: they ran under glibc's defaults
UNRECORDED = "glibc defaults (before benchmarks/malloc.py)"
# mallopt(3) parameters and the values "fixed" sets: the mmap threshold glibc's own dynamic
# threshold may grow to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX) and a trim threshold far above
# any benchmark's heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
FIXED = {"mmap_threshold": 32 << 20, "trim_threshold": 1 << 30}
ENV = {"MALLOC_MMAP_THRESHOLD_": str(FIXED["mmap_threshold"]),  # the same, for a process about to start
       "MALLOC_TRIM_THRESHOLD_": str(FIXED["trim_threshold"])}

_current = "not set (benchmarks/malloc.py: set_allocator)"


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else ValueError naming it."""
    if mode not in MODES:
        raise ValueError(f"allocator mode {mode!r}: expected one of {list(MODES)}")
    return mode


@functools.lru_cache(maxsize=None)
def _glibc() -> Optional[Any]:
    """The C library when it is glibc (``gnu_get_libc_version`` answers), else None (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def describe(mode: str) -> str:
    """What a process set to ``mode`` runs under, as results files record it (nothing is set here)."""
    check_mode(mode)
    libc = _glibc()
    if libc is None:
        return "not glibc: the C library's allocator, unchanged"
    version = libc.gnu_get_libc_version().decode()
    if mode == "default":
        return f"glibc {version}: its default (dynamic) malloc thresholds"
    return (f"glibc {version}: malloc thresholds fixed (mmap {FIXED['mmap_threshold'] >> 20} MiB, "
            f"trim {FIXED['trim_threshold'] >> 30} GiB)")


def set_allocator(mode: str) -> str:
    """Sets this process's malloc thresholds for ``mode`` (``fixed`` or ``default``) and returns
    what it runs under (:func:`describe`). Call first thing in a rank, before its tensors.
    Raises ValueError for another mode, RuntimeError when glibc refuses a value."""
    global _current
    described = describe(mode)
    libc = _glibc()
    if libc is not None and mode == "fixed":
        for param, key in ((_M_MMAP_THRESHOLD, "mmap_threshold"), (_M_TRIM_THRESHOLD, "trim_threshold")):
            if libc.mallopt(param, FIXED[key]) != 1:
                raise RuntimeError(f"{described}: glibc refused mallopt {key}={FIXED[key]}")
    _current = described
    logger.debug("allocator: %s", described)
    return described


def current() -> str:
    """What this process's allocator was last set to (:func:`set_allocator`'s description)."""
    return _current


def described(results: Iterable[dict]) -> str:
    """The allocator of these results, as one line (their ``allocator`` fields, each once; :data:`UNRECORDED` for
    results from before they had one)."""
    return "; ".join(sorted({r.get("allocator", UNRECORDED) for r in results}))


def release_freed_memory() -> None:
    """Hands free heap pages back to the kernel (glibc ``malloc_trim``; a no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def minor_faults() -> Optional[int]:
    """Minor page faults of this process so far (``/proc/self/stat``), or None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None


def faults_between(before: Optional[int], after: Optional[int]) -> Optional[int]:
    """Page faults between two :func:`minor_faults` readings (None when either is unknown)."""
    return None if before is None or after is None else after - before


def busiest_median(per_rank: List[List[Optional[int]]]) -> Optional[float]:
    """Per step the rank with the most, then the median over steps (``per_rank``: each rank's counts, step by
    step); None when a count is unknown."""
    steps = list(zip(*per_rank))
    if not steps or any(c is None for step in steps for c in step):
        return None
    return statistics.median(max(step) for step in steps)  # type: ignore[type-var]


def faults_text(faults: Optional[float]) -> str:
    """Page faults per step as the tables print them ("-": not counted)."""
    return "-" if faults is None else f"{faults:,.0f}"


def _without_malloc_tunables(tunables: str) -> str:
    return ":".join(t for t in tunables.split(":") if t and not t.startswith("glibc.malloc."))


def child_env(mode: str, environ: Optional[Iterable] = None) -> dict:
    """The environment for a process to start under ``mode`` (glibc reads it when it starts: torchrun and its
    workers): this one's (or ``environ``), with any malloc settings of its own removed (``MALLOC_*_``,
    ``glibc.malloc.*`` tunables) and, for ``fixed``, :data:`FIXED` set."""
    env = dict(os.environ if environ is None else environ)
    for key in ENV:
        env.pop(key, None)
    if "GLIBC_TUNABLES" in env:
        env["GLIBC_TUNABLES"] = _without_malloc_tunables(env["GLIBC_TUNABLES"])
        if not env["GLIBC_TUNABLES"]:
            del env["GLIBC_TUNABLES"]
    if check_mode(mode) == "fixed":
        env.update(ENV)
    return env
