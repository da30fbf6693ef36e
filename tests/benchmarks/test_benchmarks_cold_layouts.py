"""`python -m benchmarks.cold_layouts` at a tiny size: the heaviest table's other cold layouts
are built, trained beside the plan as returned and the stock plan, and reported."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cold_layouts_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cold_layouts", "--world", "2", "--rows-cap", "2000",
                           "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "cold_layouts.json").read_text())
    assert r["table"] == "t_cat_20"  # DLRMv2's 100-id bags: the most lookups
    names = list(r["plans"])
    assert names[1] == "stock_planner" and names[0].startswith("hybrid_planner_bytes (")
    current = names[0].split("(")[1].split(" ")[0]
    others = {n.split(" ")[1] for n in names[2:]}
    assert others == {"table_wise", "row_wise", "column_wise"} - {current}, names
    for n, p in r["plans"].items():
        assert len(p["cpu_ms_per_rank"]) == 2 and min(p["cpu_ms_per_rank"]) > 0, n
        assert p["busiest_bytes"] >= p["mean_bytes"] > 0 and p["median_step_ms"] > 0, n
    assert r["plans"]["stock_planner"]["step_vs_stock"] == 1.0
    # a row-wise cold table returns a partial sum from every owner a bag's cold ids touch: more bytes
    if current != "row_wise":
        assert r["plans"]["t_cat_20 row_wise cold"]["mean_bytes"] > r["plans"][names[0]]["mean_bytes"]
    md = (tmp_path / "cold_layouts.md").read_text()
    assert all(f"| {n} |" in md for n in names)
