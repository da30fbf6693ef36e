"""`python -m benchmarks.product` at a tiny size: the hybrid planner's plans (CPU- and
network-priced) against TorchRec's planner's, trained interleaved on the same batches; bytes
per rank and the step ratios, with the paired per-step ratio's median and its 95% interval, pooled over
runs in fresh processes, and each run's own median."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.measure import median_ci

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("n", [1, 5, 6, 16, 40, 41, 180])
def test_median_ci_is_the_widest_exact_binomial_interval_of_95_percent(n):
    xs = [((7 * i) % n) / 3.0 for i in range(n)]  # a permutation: the order must not matter
    lo, mid, hi = median_ci(xs)
    s = sorted(xs)
    k = s.index(lo)
    assert lo <= mid <= hi and s[n - 1 - k] == hi  # symmetric order statistics
    below = lambda j: sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n  # noqa: E731 - P(Bin(n, 1/2) <= j)
    if n < 6:  # no order statistic gives 95%: the whole range
        assert k == 0 and below(0) > 0.025
    else:  # P(s[k] above the median) <= 0.025, and one rank further in it would not be
        assert below(k) <= 0.025 < below(k + 1)


def test_paired_step_ratios_pair_each_batch_on_its_slowest_rank():
    from benchmarks.product import paired_step_ratios

    # two ranks, five batches: per batch the slowest rank's time, plan over stock on that batch
    outs = [{"times": {"plan": [2.0, 1.0, 9.0, 4.0, 3.0], "stock": [1.0, 2.0, 3.0, 8.0, 1.0]}},
            {"times": {"plan": [1.0, 4.0, 3.0, 2.0, 6.0], "stock": [4.0, 1.0, 9.0, 2.0, 2.0]}}]
    assert paired_step_ratios(outs, "plan", "stock") == [2.0 / 4.0, 4.0 / 2.0, 9.0 / 9.0, 4.0 / 8.0, 6.0 / 2.0]


def test_product_tiny(tmp_path):
    world, steps = 2, 6
    proc = subprocess.run([sys.executable, "-m", "benchmarks.product", "--world", str(world), "--rows-cap", "2000",
                           "--steps", str(steps), "--warmup", "1", "--workloads", "onehot", "--repeats", "2",
                           "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = json.loads((tmp_path / "product.json").read_text())["results"]
    assert r["workload"] == "onehot" and r["world"] == world
    assert r["threads"] == 1 and r["torch_threads"] == 1  # the default: one intra-op thread per rank
    stock = r["stock_planner"]
    for m, q in r["ratios"].items():
        assert q["busiest"] == r[m]["busiest_bytes"] / stock["busiest_bytes"], m
        lo, mid, hi = q["paired_step_ci"]
        assert 0 < lo <= mid <= hi, m
        assert len(q["paired_step_runs"]) == 2 and min(q["paired_step_runs"]) > 0, m  # each run's own median
        assert len(r[m]["sent_per_rank"]) == world
    from benchmarks import malloc

    assert r["allocator"] == malloc.describe("fixed")  # the ranks ran under the default mode, and say so
    for m in ("hybrid_planner", "hybrid_planner_bytes", "stock_planner"):
        assert isinstance(r[m]["page_faults_per_step"], (int, float)), m  # counted per timed step (None: not)
    md = (tmp_path / "product.md").read_text()
    assert f"Allocator: {r['allocator']}." in md
    assert f"| {malloc.faults_text(r['stock_planner']['page_faults_per_step'])} |" in md
    assert "per-step ratio: median [95% CI] (each run's median)" in md
    for m, q in r["ratios"].items():
        (lo, mid, hi), runs = q["paired_step_ci"], q["paired_step_runs"]
        assert f"| {mid:.2f}x [{lo:.2f}, {hi:.2f}] (runs {min(runs):.2f}-{max(runs):.2f}) |" in md, m


def test_product_refuses_fewer_than_no_threads(tmp_path, capsys):
    from benchmarks import product

    with pytest.raises(SystemExit) as e:
        product.main(["--threads", "-2", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--threads must be >= 0, got -2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_product_records_its_threads(tmp_path):
    """``--threads 2``: each rank runs two intra-op threads, and the results say so (JSON and the report's legend);
    the reports of results from before --threads say one per rank."""
    from benchmarks import stepping

    proc = subprocess.run([sys.executable, "-m", "benchmarks.product", "--world", "2", "--rows-cap", "2000",
                           "--steps", "2", "--warmup", "1", "--stats-batches", "2", "--workloads", "onehot",
                           "--threads", "2", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "product.json").read_text())
    (r,) = data["results"]
    assert data["args"]["threads"] == 2 and r["threads"] == 2 and r["torch_threads"] == 2
    assert "Intra-op threads: 2 per rank (torch.set_num_threads(2))." in (tmp_path / "product.md").read_text()
    assert stepping.threads_text([{}]) == "1 per rank (torch.set_num_threads(1))"
    default = stepping.threads_text([{"threads": 0, "torch_threads": 8}])
    assert default == "torch's default per rank (8 here; --threads 0)"
