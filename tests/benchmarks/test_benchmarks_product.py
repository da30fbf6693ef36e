"""`python -m benchmarks.product` at a tiny size: the hybrid planner's plans (CPU- and
network-priced) against TorchRec's planner's, trained interleaved on the same batches; bytes
per rank and the step ratios, with the paired per-step ratio's median and its 95% interval."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.measure import median_ci

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("n", [1, 5, 6, 40, 41])
def test_median_ci_brackets_the_median_with_symmetric_order_statistics(n):
    xs = [((7 * i) % n) / 3.0 for i in range(n)]  # a permutation: the order must not matter
    lo, mid, hi = median_ci(xs)
    s = sorted(xs)
    assert lo <= mid <= hi and lo in xs and hi in xs
    assert sum(x < lo for x in xs) == sum(x > hi for x in xs)  # as many left out below as above
    if n < 6:  # too few for any order statistic to be left out
        assert (lo, hi) == (s[0], s[-1])
    if n >= 40:  # the benchmarks' 40 steps: the interval is narrower than the range
        assert s[0] < lo and hi < s[-1]


def test_product_tiny(tmp_path):
    world, steps = 2, 6
    proc = subprocess.run([sys.executable, "-m", "benchmarks.product", "--world", str(world), "--rows-cap", "2000",
                           "--steps", str(steps), "--warmup", "1", "--workloads", "onehot", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = json.loads((tmp_path / "product.json").read_text())["results"]
    assert r["workload"] == "onehot" and r["world"] == world
    stock = r["stock_planner"]
    for m, q in r["ratios"].items():
        assert q["busiest"] == r[m]["busiest_bytes"] / stock["busiest_bytes"], m
        lo, mid, hi = q["paired_step_ci"]
        assert 0 < lo <= mid <= hi, m
        assert len(r[m]["sent_per_rank"]) == world
    md = (tmp_path / "product.md").read_text()
    assert "per-step ratio: median [95% CI]" in md
    for m, q in r["ratios"].items():
        lo, mid, hi = q["paired_step_ci"]
        assert f"| {mid:.2f}x [{lo:.2f}, {hi:.2f}] |" in md, m
