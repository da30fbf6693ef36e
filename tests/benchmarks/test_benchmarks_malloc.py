"""benchmarks/malloc.py: the allocator modes the benchmarks' ranks run under, and the page-fault counter."""

import os
import subprocess
import sys

import pytest

from benchmarks import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLIBC = malloc._glibc() is not None


def _fresh(code: str) -> str:
    """``code``'s output in a fresh interpreter (a process whose malloc nothing has tuned yet)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=malloc.child_env("default"))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="'jemalloc'"):
        malloc.set_allocator("jemalloc")
    with pytest.raises(ValueError, match="'fast'"):
        malloc.child_env("fast")


@pytest.mark.skipif(not GLIBC, reason="mallopt thresholds are glibc's")
@pytest.mark.parametrize("mode", malloc.MODES)
def test_fixed_thresholds_keep_a_large_block_in_the_heap(mode):
    """A 24 MiB block: above glibc's default mmap threshold (mapped on its own, ``mallinfo2().hblkhd``), below the
    fixed one (from the heap, no mapping)."""
    code = f"""
import ctypes
from benchmarks import malloc
print(malloc.set_allocator({mode!r}) == malloc.current() == malloc.describe({mode!r}))
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblkhd
block = libc.malloc(24 << 20)
print(libc.mallinfo2().hblkhd - before)
"""
    same, mapped = _fresh(code).split()
    assert same == "True"
    if mode == "fixed":
        assert int(mapped) == 0
    else:
        assert int(mapped) >= 24 << 20


def test_minor_faults_count_freshly_touched_pages():
    code = """
import torch
from benchmarks import malloc
f0 = malloc.minor_faults()
t = torch.ones(16 << 20)  # 64 MiB, above any threshold: new pages
print(malloc.faults_between(f0, malloc.minor_faults()))
"""
    assert int(_fresh(code)) >= 64 * 2 ** 20 // (2 << 20)  # one per page: 4 KiB pages, or 2 MiB huge pages
    assert malloc.faults_between(None, 5) is None and malloc.faults_between(3, 5) == 2


def test_busiest_median_takes_each_steps_busiest_rank():
    assert malloc.busiest_median([[1, 10, 3], [4, 2, 3]]) == 4  # steps' busiest: 4, 10, 3
    assert malloc.busiest_median([[1, None], [2, 3]]) is None
    assert malloc.faults_text(None) == "-" and malloc.faults_text(5089.0) == "5,089"


def test_child_env_sets_or_clears_the_malloc_settings(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096:glibc.rtld.nns=8")
    fixed, default = malloc.child_env("fixed"), malloc.child_env("default")
    assert {k: fixed[k] for k in malloc.ENV} == malloc.ENV
    assert not set(malloc.ENV) & set(default)
    assert fixed["GLIBC_TUNABLES"] == default["GLIBC_TUNABLES"] == "glibc.rtld.nns=8"
    assert default["PATH"] == os.environ["PATH"]
