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
                           "--steps", "3", "--warmup", "2", "--workloads", "onehot", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = json.loads((tmp_path / "same_plan.json").read_text())["results"]
    assert r["plan_types"] == {"table_wise": 26} and r["steps"] == 3
    models = r["models"]
    assert list(models) == ["stock sharder", "our sharder", "our sharder, validate_ids=False"]
    stock = models["stock sharder"]
    assert stock["step_vs_stock"] == 1.0 and stock["paired_ratio_quartiles"] == [1.0, 1.0, 1.0]
    for n, m in models.items():
        assert m["median_step_ms"] > 0 and m["cpu_ms_per_step_all_ranks"] > 0, n
        for key in ("paired_ratio_quartiles", "paired_ratio_median_ci", "paired_vs_unchecked_median_ci"):
            lo, mid, hi = m[key]
            assert 0 < lo <= mid <= hi, (n, key)
    report = 3 * 8 * (world - 1) * 3  # three int64 words to each other rank, each of the 3 timed steps
    totals = {n: m["sent_bytes_total_per_rank"] for n, m in models.items()}
    assert len(totals["stock sharder"]) == world and min(totals["stock sharder"]) > 0
    assert totals["our sharder, validate_ids=False"] == totals["stock sharder"]
    assert totals["our sharder"] == [b + report for b in totals["stock sharder"]]
    md = (tmp_path / "same_plan.md").read_text()
    assert all(f"| onehot | {world} | {n} |" in md for n in models)
