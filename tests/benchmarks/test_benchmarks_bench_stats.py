"""`python -m benchmarks.bench_stats` at a tiny size: exact counts and the sketch timed, one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_stats_tiny():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_stats", "--max-rows", "1000", "--batch-size", "1024",
                           "--batches", "2", "--repeats", "1", "--sketch-rows", "20000", "--sketch-ids", "20000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "stats" and r["exact"]["ids_per_s"] > 0 and r["sketch"]["ids_per_s"] > 0
    assert 0.0 <= r["sketch"]["recall_top1pct"] <= 1.0
