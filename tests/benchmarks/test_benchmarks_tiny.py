"""`python -m benchmarks --tiny` runs in seconds and its JSON holds every configuration it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.config import PLANNER_TYPES, SHARDING_TYPES, hot_row_sweep, mode_workloads

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # --warmup/--steps: tiny's own values, so the override path runs without changing the run
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--tiny", "--out", str(out), "--warmup", "1",
                           "--steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "tiny.json").read_text())


def test_every_promised_configuration_is_there(tiny):
    _, doc = tiny
    assert doc["overrides"] == {"warmup": 1, "steps": 3}
    names = [c["workload"]["name"] for c in doc["configurations"]]
    assert names == [w.name for w in mode_workloads("tiny")]
    kinds = {(c["workload"]["model"], c["workload"]["multi_hot"]) for c in doc["configurations"]}
    assert ("ebc", False) in kinds and ("dlrm", True) in kinds
    assert {c["workload"]["alpha"] for c in doc["configurations"]} == {1.1, 0.0}
    assert [c["workload"]["name"] for c in doc["hot_row_sweep"]] == [w.name for w in hot_row_sweep("tiny")]
    for c in doc["configurations"]:
        assert set(c["results"]) == set(c["workload"]["types"]) >= set(SHARDING_TYPES), c["workload"]["name"]
        for kind, r in c["results"].items():
            assert r["bytes_per_rank_per_step"] > 0 and r["expected_bytes_per_rank_per_step"] > 0, kind
            t = r["step_time_s"]
            assert 0 < t["min"] <= t["median"] <= t["max"] and t["n"] == c["workload"]["steps"], kind
            assert r["peak_mem_bytes_per_rank"] > 0, kind
        assert {"bytes_hybrid_over_table_wise", "time_hybrid_over_fastest_stock"} <= set(c["ratios"])


def test_hybrid_planner_plans_are_measured(tiny):
    """The plans HybridEmbeddingShardingPlanner returns run beside the stock ones (a DLRM here), each priced by the
    planner's own estimate, which the measured bytes bear out, and compared with the stock planner's plan."""
    _, doc = tiny
    with_planners = [c for c in doc["configurations"] if set(PLANNER_TYPES) <= set(c["results"])]
    assert with_planners and all(c["workload"]["model"] == "dlrm" for c in with_planners)
    for c in with_planners:
        assert set(c["ratios"]["planners"]) == set(PLANNER_TYPES)
        for kind in PLANNER_TYPES:
            r = c["results"][kind]
            assert abs(r["expected_bytes_per_rank_per_step"] / r["bytes_per_rank_per_step"] - 1) < 0.1, kind
            q = c["ratios"]["planners"][kind]
            assert q["busiest_bytes_over_planner"] == (r["bytes_per_rank_per_step_max_rank"] / c["results"]["planner"][
                "bytes_per_rank_per_step_max_rank"])
        assert c["results"]["hybrid_planner_bytes"]["planned_types"].get("frequency_hybrid", 0) > 0


def test_hybrid_bytes_are_consistent(tiny):
    """Measured hybrid bytes drop as hot rows grow, and table_wise matches its model within 2%."""
    _, doc = tiny
    sweep = sorted(doc["hot_row_sweep"], key=lambda c: c["hot_set"]["hot_rows_total"])
    hy = [c["results"]["frequency_hybrid"]["bytes_per_rank_per_step"] for c in sweep]
    assert hy[-1] < hy[0]
    for c in doc["configurations"]:
        tw = c["results"]["table_wise"]
        assert abs(tw["expected_bytes_per_rank_per_step"] / tw["bytes_per_rank_per_step"] - 1) < 0.02


def test_outputs_written(tiny):
    out, doc = tiny
    assert (out / "tiny.md").read_text().count("| frequency_hybrid |") == len(doc["configurations"]) + len(
        doc["hot_row_sweep"])
    for name in ("tiny_bytes_vs_alpha.png", "tiny_bytes_vs_hot_rows.png"):
        assert (out / name).stat().st_size > 1000, name
