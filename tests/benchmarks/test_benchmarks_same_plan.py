"""`python -m benchmarks.same_plan` at a tiny size: TorchRec's planner's plan under TorchRec's
sharder, ours and ours without the id check, trained interleaved and reported. On the same plan
our sharder sends what TorchRec's sends, plus, with the id check, each rank's 3-word report to
every other rank (it rides the stock split-size all-to-all): counted at the OS level."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_same_plan_tiny(tmp_path):
    world = 2
    proc = subprocess.run([sys.executable, "-m", "benchmarks.same_plan", "--world", str(world), "--rows-cap", "2000",
                           "--steps", "3", "--warmup", "1", "--workloads", "onehot", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = json.loads((tmp_path / "same_plan.json").read_text())["results"]
    assert r["plan_types"] == ["table_wise"] and r["steps"] == 3
    models = r["models"]
    assert list(models) == ["stock sharder", "our sharder", "our sharder, validate_ids=False"]
    stock = models["stock sharder"]
    assert stock["step_vs_stock"] == 1.0 and stock["paired_ratio_quartiles"] == [1.0, 1.0, 1.0]
    for n, m in models.items():
        assert m["median_step_ms"] > 0 and m["cpu_ms_sum"] > 0, n
        lo, mid, hi = m["paired_ratio_quartiles"]
        assert 0 < lo <= mid <= hi, n
    report = 3 * 8 * (world - 1)  # three int64 words to each other rank per step
    assert models["our sharder, validate_ids=False"]["busiest_bytes"] == stock["busiest_bytes"]
    assert models["our sharder"]["busiest_bytes"] == stock["busiest_bytes"] + report
    md = (tmp_path / "same_plan.md").read_text()
    assert all(f"| onehot | {world} | {n} |" in md for n in models)
