"""`python -m benchmarks.cpu_phases` at a tiny size: both plans' main-thread CPU per part of a step,
and every timed phase of the hybrid's, at two batch sizes; the timers leave our code as it was."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_phases_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cpu_phases", "--world", "2", "--rows-cap", "2000",
                           "--batches", "32", "4", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "cpu_phases.json").read_text())
    assert [run["batch"] for run in r["runs"]] == [32, 4]
    # the same plans at both batches (planned for the workload's)
    first, second = (run["plans"]["hybrid_planner_bytes"]["types"] for run in r["runs"])
    assert first == second
    from benchmarks.cpu_phases import PARTS, PHASES, PLANS

    for run in r["runs"]:
        assert list(run["plans"]) == list(PLANS)
        assert any(t.startswith("frequency_hybrid") for t in run["plans"]["hybrid_planner_bytes"]["types"])
        assert run["plans"]["stock_planner"]["types"] == {"table_wise": 26}
        for name, p in run["plans"].items():
            for part in PARTS:
                assert len(p["main_thread_ms"][part]) == 2 and min(p["main_thread_ms"][part]) > 0, (name, part)
            assert min(p["process_ms"]) > 0
        # every phase runs on every rank every step of the hybrid plan
        assert set(run["hybrid_phases_ms"]) == {label for label, *_ in PHASES}
        for label, per_rank in run["hybrid_phases_ms"].items():
            assert len(per_rank) == 2 and min(per_rank) > 0, label
    md = (tmp_path / "cpu_phases.md").read_text()
    assert all(f"| {label} |" in md for label, *_ in PHASES)


def test_phase_timers_put_the_originals_back():
    from collections import defaultdict

    from benchmarks.cpu_phases import phase_timers
    from torchrec_hybrid.sharding import input_dist, output_dist

    route, unpack = input_dist.HybridSparseFeaturesDist._route, vars(output_dist._AllToAllWait)["forward"]
    totals = defaultdict(float)
    with phase_timers(totals):
        assert input_dist.HybridSparseFeaturesDist._route is not route
        # autograd still finds a staticmethod
        assert isinstance(vars(output_dist._AllToAllWait)["forward"], staticmethod)
    assert input_dist.HybridSparseFeaturesDist._route is route
    assert vars(output_dist._AllToAllWait)["forward"] is unpack
