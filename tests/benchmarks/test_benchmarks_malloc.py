"""benchmarks/malloc.py: the allocator modes the benchmarks' ranks run under, and the page-fault counter."""

import os
import subprocess
import sys

import pytest

from benchmarks import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="'jemalloc'"):
        malloc.set_allocator("jemalloc")
    with pytest.raises(ValueError, match="'fast'"):
        malloc.child_env("fast")


def _touch_fresh_pages(mode: str) -> str:
    """In a fresh interpreter: set ``mode``, then allocate, fill and free the same 64 MiB block (above any mmap
    threshold: every round maps new pages) three times; prints the description and the faults counted."""
    code = ("import torch\nfrom benchmarks import malloc\nd = malloc.set_allocator(%r)\nf0 = malloc.minor_faults()\n"
            "for _ in range(3):\n    t = torch.ones(16 << 20)\n    del t\n"
            "print(d == malloc.current(), d, malloc.minor_faults() - f0, sep='|')" % mode)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("mode", malloc.MODES)
def test_set_allocator_says_what_it_set_and_faults_are_counted(mode):
    same, described, faults = _touch_fresh_pages(mode).split("|")
    assert same == "True" and described == malloc.describe(mode)
    if "glibc" in described:
        assert ("fixed" in described) == (mode == "fixed"), described
    # 3 x 64 MiB of freshly mapped pages: thousands of 4 KiB pages (or some 2 MiB ones)
    assert int(faults) >= 3 * 32, faults


def test_child_env_sets_or_clears_glibcs_thresholds(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    fixed, default = malloc.child_env("fixed"), malloc.child_env("default")
    assert {k: fixed[k] for k in malloc.ENV} == malloc.ENV
    assert not set(malloc.ENV) & set(default)
    assert default["PATH"] == os.environ["PATH"]
