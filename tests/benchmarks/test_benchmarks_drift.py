"""`python -m benchmarks.drift --tiny` runs in seconds and writes its JSON, markdown and plot."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(out, *args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.drift", "--tiny", "--no-progress", "--out", str(out),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "drift.json").read_text())


def test_drift_tiny(tmp_path):
    r = _run(tmp_path)
    assert r["world"] == 2 and r["steps"] == 12 and r["x"] == [4, 8, 12]
    for m in ("static", "refreshed", "ideal", "stock"):
        assert len(r["points"][m]["mean"]) == 3 and all(v > 0 for v in r["points"][m]["busiest"]), m
        assert r["runs"][m]["busiest_bytes"] >= r["runs"][m]["mean_bytes"] > 0
    assert r["ratio_to_ideal"]["ideal"] == [1.0, 1.0, 1.0]
    rf = r["refresh"]
    assert rf["count"] == 2 and [p["step"] for p in rf["per_refresh"]] == [4, 8]
    assert rf["mean_merge_bytes_per_rank"] > 0 and rf["mean_time_s"] > 0
    assert sum(p["ideal_changed"] for p in rf["per_refresh"]) > 0  # the data drifted
    # before the first refresh the three hybrids hold the same hot set: same bytes
    first = [r["points"][m]["mean"][0] for m in ("static", "refreshed", "ideal")]
    assert max(first) <= min(first) * 1.001
    md = (tmp_path / "drift.md").read_text()
    assert all(f"| {m} |" in md for m in ("static", "refreshed", "ideal", "stock")) and "refresh (2 of them" in md
    assert (tmp_path / "drift.png").stat().st_size > 5000
    # the defaults: a decay chosen at each refresh among AdaptiveHotSets' candidates, the top-candidate merge
    from torchrec_hybrid.stats.adaptive import DECAYS

    assert all(p["decay"] in DECAYS for p in rf["per_refresh"]) and r["args"]["merge"] == "top"
    assert r["acceptance"]["merge_share_of_saving"] is None or r["acceptance"]["merge_share_of_saving"] > 0
    assert len(r["ratio_to_ideal"]["refreshed_with_refresh"]) == 3
    # the user's decay and the dense merge: the decay as given; every counter travels, more bytes
    dense = _run(tmp_path / "dense", "--merge", "dense", "--decay", "0.9")
    assert all(p["decay"] == 0.9 for p in dense["refresh"]["per_refresh"])
    assert dense["refresh"]["mean_merge_bytes_per_rank"] > rf["mean_merge_bytes_per_rank"]
