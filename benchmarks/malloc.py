"""The C allocator the benchmarks' ranks run under, and the page faults a step costs.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc's default thresholds are
*dynamic*: a large block goes back to the kernel when freed (``munmap``, or a trim of the
heap's top), and the next step's buffer of that size is then zero-filled by the kernel page
by page on first touch: minor page faults, which cost CPU time in the step. Whether a block
goes back depends on the order the heap saw sizes in, not only on the plan, so two runs of
the same plan, or two ranks of one run, can differ by thousands of faults per step
(``benchmarks/results/product_w4_glibc.md`` against ``product_w4.md``). A GPU's caching
allocator keeps its blocks, and so do jemalloc and tcmalloc on CPU: there these faults do not
exist. So every benchmark rank runs with glibc's thresholds *fixed* (:data:`FIXED`: nothing
below 32 MiB is mmapped, the heap's top is not trimmed below 1 GiB), which keeps a step's
blocks in the process; ``default`` leaves glibc as it is (what a CPU job that does not tune
its allocator gets). Results files record which (:func:`set_allocator`'s description).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any, Callable, List, Optional

logger = logging.getLogger(__name__)

MODES = ("fixed", "default")
DEFAULT_MODE = "fixed"
# mallopt(3) parameters and the values "fixed" sets: glibc's largest mmap threshold on 64-bit
# (HEAP_MAX_SIZE / 2) and a trim threshold far above any benchmark's heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
FIXED = {"mmap_threshold": 32 << 20, "trim_threshold": 1 << 30}
ENV = {"MALLOC_MMAP_THRESHOLD_": str(FIXED["mmap_threshold"]),  # the same, for a process about to start
       "MALLOC_TRIM_THRESHOLD_": str(FIXED["trim_threshold"])}


_current = "not set (benchmarks/malloc.py: set_allocator)"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"allocator mode {mode!r}: expected one of {list(MODES)}")
    return mode


def _glibc() -> Optional[Any]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): no mallopt thresholds to fix
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


def minor_faults() -> int:
    """Minor page faults of this process so far (``/proc/self/stat``; -1 where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return -1


def current() -> str:
    """What this process's allocator was last set to (:func:`set_allocator`'s description)."""
    return _current


def _rank(rank: int, world: int, emit: Callable, _fn: Callable, _malloc: str, **kwargs: Any) -> None:
    set_allocator(_malloc)
    _fn(rank, world, emit, **kwargs)


def spawn_ranks(fn: Callable, world: int, *, malloc: str = DEFAULT_MODE, **kwargs: Any) -> List[List[Any]]:
    """``torchrec_hybrid.spawn.spawn_ranks`` with every rank's allocator set first (:func:`set_allocator`)."""
    from torchrec_hybrid import spawn

    return spawn.spawn_ranks(_rank, world, _fn=fn, _malloc=check_mode(malloc), **kwargs)


def child_env(mode: str) -> dict:
    """The environment for a process to start under ``mode`` (glibc reads ``MALLOC_*_`` when it starts:
    torchrun and its workers): this one's, with the thresholds set for ``fixed`` or removed for ``default``."""
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    if check_mode(mode) == "fixed":
        env.update(ENV)
    return env
