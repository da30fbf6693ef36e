"""`python -m benchmarks.candidates` at a tiny size: every candidate plan of both pricings is trained,
identical ones once, and each planner's choice is marked on exactly one of them."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_candidates_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.candidates", "--world", "2", "--rows-cap", "2000",
                           "--steps", "2", "--warmup", "1", "--workloads", "onehot", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = json.loads((tmp_path / "candidates.json").read_text())
    plans = r["plans"]
    # TorchRec's plan is a candidate of both pricings and trains once, as the stock reference
    stock = [p for p in plans if "stock: TorchRec's EmbeddingShardingPlanner" in p["names"]]
    assert len(stock) == 1 and set(stock[0]["priced"]) == {"hybrid_planner", "hybrid_planner_bytes"}
    assert stock[0]["paired_step_ci"] == [1.0, 1.0, 1.0] and stock[0]["cpu_vs_stock"] == 1.0
    for pricing in ("hybrid_planner", "hybrid_planner_bytes"):
        priced = [p for p in plans if pricing in p["priced"]]
        assert len(priced) >= 2, pricing
        chosen = [p for p in priced if p["priced"][pricing]["chosen"]]
        assert len(chosen) == 1, pricing
        # the marked candidate is the plan collective_plan returned on every rank
        assert chosen[0]["types"] == r["returned"][pricing], pricing
        # the planner never returns more busiest-rank bytes than TorchRec's plan, by its own estimate
        assert chosen[0]["priced"][pricing]["busiest_bytes"] <= stock[0]["priced"][pricing]["busiest_bytes"]
    for p in plans:
        assert p["median_step_ms"] > 0 and p["cpu_ms_sum"] > 0 and p["busiest_bytes"] >= p["mean_bytes"] > 0
        assert sum(p["types"].values()) == 26
    md = (tmp_path / "candidates.md").read_text()
    assert md.count("| onehot | 2 |") == len(plans)
