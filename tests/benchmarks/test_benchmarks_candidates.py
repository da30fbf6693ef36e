"""`python -m benchmarks.candidates` at a tiny size: every candidate plan of both pricings is trained,
identical ones once, and each planner's choice is marked on exactly one of them; per pricing, whether the plan
it returned stepped within 5% of the fastest candidate it weighed; the same on a shaped loopback, planned for the
measured network; ``--threads`` recorded and its negative values refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import candidates, shaped_loopback

ROOT = Path(__file__).resolve().parents[2]
PRICINGS = ("hybrid_planner", "hybrid_planner_bytes")


def _run(tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.candidates", "--world", "2", "--rows-cap", "2000",
                           "--warmup", "1", "--workloads", "onehot", "--out", str(tmp_path), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != shaped_loopback.ENV})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((tmp_path / "candidates.json").read_text())


def _check_plans(r):
    plans = r["plans"]
    # TorchRec's plan is a candidate of both pricings and trains once, as the stock reference
    stock = [p for p in plans if "stock: TorchRec's EmbeddingShardingPlanner" in p["names"]]
    assert len(stock) == 1 and set(stock[0]["priced"]) == set(PRICINGS)
    assert stock[0]["paired_step_ci"] == [1.0, 1.0, 1.0] and stock[0]["cpu_vs_stock"] == 1.0
    for pricing in PRICINGS:
        priced = [p for p in plans if pricing in p["priced"]]
        assert len(priced) >= 2, pricing
        chosen = [p for p in priced if p["priced"][pricing]["chosen"]]
        assert len(chosen) == 1, pricing
        # the marked candidate is the plan collective_plan returned on every rank
        assert chosen[0]["types"] == r["returned"][pricing], pricing
        # the planner never returns more busiest-rank bytes than TorchRec's plan, by its own estimate
        assert chosen[0]["priced"][pricing]["busiest_bytes"] <= stock[0]["priced"][pricing]["busiest_bytes"]
        # the verdict: the returned candidate against the fastest one that pricing weighed
        v = r["verdicts"][pricing]
        assert v["candidates"] == len(priced) and v["returned"] == chosen[0]["label"]
        fastest = min(priced, key=lambda p: p["median_step_ms"])
        assert v["fastest"] == fastest["label"] and v["fastest_step_ms"] == fastest["median_step_ms"]
        assert v["returned_vs_fastest"] == pytest.approx(chosen[0]["median_step_ms"] / fastest["median_step_ms"])
        assert v["returned_vs_fastest"] >= 1.0 and v["within_5pct"] == (v["returned_vs_fastest"] <= 1.05)
        lo, mid, hi = v["paired_vs_fastest_ci"]
        assert 0 < lo <= mid <= hi
    for p in plans:
        assert p["median_step_ms"] > 0 and p["cpu_ms_sum"] > 0 and p["busiest_bytes"] >= p["mean_bytes"] > 0
        assert sum(p["types"].values()) == 26
        lo, mid, hi = p["paired_step_ci"]
        assert 0 < lo <= mid <= hi


def test_candidates_tiny(tmp_path):
    """Unshaped, unmeasured, torch's default threads per rank (--threads 0)."""
    proc, (r,) = _run(tmp_path, "--steps", "2", "--threads", "0")
    _check_plans(r)
    assert r["threads"] == 0 and r["torch_threads"] >= 1
    assert r["network"] == {"rate": "unshaped", "rate_bits_per_s": None, "measured": None}
    md = (tmp_path / "candidates.md").read_text()
    assert md.count("| onehot | 2 |") == len(r["plans"]) + len(PRICINGS)  # every candidate, then each verdict
    assert f"Intra-op threads: torch's default per rank ({r['torch_threads']} here; --threads 0)." in md
    # the table as docs_figures takes it: the legend and the allocator / threads line cut, nothing else
    table = candidates.markdown([r])[2:-2]
    assert table[0].startswith("| workload | W | candidate |") and len(table) == 2 + len(r["plans"])
    assert md.startswith("# Every candidate plan, trained (intra-op threads: torch's default per rank")
    assert "## Network" not in md and "| network |" not in md
    for pricing in PRICINGS:
        v = r["verdicts"][pricing]
        assert (f"| onehot | 2 | {pricing} | {'; '.join(v['returned_names'])} | {v['returned_step_ms']:.1f} | "
                f"{'; '.join(v['fastest_names'])} | {v['fastest_step_ms']:.1f} | {v['returned_vs_fastest']:.2f}x |"
                in md), pricing
        assert f"onehot W=2 {pricing}: {candidates.verdict_text(v)}" in proc.stderr
    assert "unshaped: the returned plan within 5% of the fastest candidate in " in proc.stderr


def test_candidates_on_a_shaped_loopback(tmp_path):
    """W=2 on a loopback shaped to 2gbit: the module re-runs itself in the namespace; the merged results carry the
    measured network both planners planned for, every candidate of both pricings and each one's verdict."""
    reason = shaped_loopback.unavailable("2gbit")
    if reason:
        pytest.skip(f"no shaped loopback here: {reason}")
    proc, (r,) = _run(tmp_path, "--steps", "3", "--stats-batches", "2", "--network", "2gbit")
    assert (tmp_path / "network-2gbit" / "candidates.json").exists()  # the shaped process's own file
    assert r["threads"] == 1 and r["torch_threads"] == 1
    net = r["network"]
    assert net["rate"] == "2gbit" and net["rate_bits_per_s"] == 2e9
    m = net["measured"]
    assert m["world_size"] == 2 and m["backend"] == "gloo"
    assert 0.2 < m["aggregate_gbit_s"] < 4.0, m  # a token bucket at 2 Gbit/s for all ranks together
    _check_plans(r)
    md = (tmp_path / "candidates.md").read_text()
    assert md.count("| 2gbit | onehot | 2 |") == len(r["plans"]) + len(PRICINGS) + 1  # + the network's row
    assert "## Network" in md and "## Returned vs fastest" in md
    tag = f"[2gbit, measured {candidates.gbit(m['aggregate_gbit_s'])} Gbit/s all ranks]"
    for pricing in PRICINGS:
        v = r["verdicts"][pricing]
        assert f"| {v['returned_vs_fastest']:.2f}x | " in md and f"| {v['verdict']} |" in md
        assert f"onehot W=2 {pricing} {tag}: {candidates.verdict_text(v)}" in proc.stderr
    within = sum(r["verdicts"][p]["within_5pct"] for p in PRICINGS)
    assert (f"2gbit (measured {candidates.gbit(m['aggregate_gbit_s'])} Gbit/s all ranks): the returned plan within "
            f"5% of the fastest candidate in {within} of 2 (workload, pricing)") in proc.stderr


def _plan(label, steps, chosen_by=(), weighed_by=PRICINGS, names=("a plan",)):
    return {"label": label, "names": list(names), "median_step_ms": steps,
            "priced": {m: {"names": list(names), "chosen": m in chosen_by} for m in weighed_by}}


def test_the_verdict_compares_the_returned_plan_with_the_fastest_its_pricing_weighed():
    plans = [_plan("plan 0", 10.0, names=[candidates.STOCK]),
             _plan("plan 1", 10.3, chosen_by=("hybrid_planner",), weighed_by=("hybrid_planner",),
                   names=[candidates.MIXED]),
             _plan("plan 2", 9.6, weighed_by=("hybrid_planner",), names=[candidates.ALL_HYBRID]),
             _plan("plan 3", 10.9, chosen_by=("hybrid_planner_bytes",), weighed_by=("hybrid_planner_bytes",))]
    step = {p["label"]: [p["median_step_ms"] / 1e3] * 3 for p in plans}
    v = candidates.verdicts(plans, step)
    cpu, net = v["hybrid_planner"], v["hybrid_planner_bytes"]
    assert cpu["returned"] == "plan 1" and cpu["fastest"] == "plan 2" and cpu["candidates"] == 3
    assert cpu["returned_vs_fastest"] == pytest.approx(10.3 / 9.6) and not cpu["within_5pct"]  # 1.07x
    assert cpu["verdict"] == "NOT within 5%"
    assert cpu["paired_vs_fastest_ci"] == pytest.approx([10.3 / 9.6] * 3)
    # the network-priced planner weighed the stock plan and its own: plan 2 is not its to return
    assert net["fastest"] == "plan 0" and net["returned_vs_fastest"] == pytest.approx(1.09)
    assert candidates.verdict_text(cpu) == "returned mixed, 1.07x the fastest (all-hybrid): NOT within 5%"
    plans[1]["median_step_ms"] = 9.9  # 1.03x: within
    assert candidates.verdicts(plans, step)["hybrid_planner"]["verdict"] == "within 5%"
    plans[1]["median_step_ms"] = 9.0  # the fastest itself
    fast = candidates.verdicts(plans, step)["hybrid_planner"]
    assert fast["within_5pct"] and fast["verdict"] == "within 5% (the fastest)" and fast["returned_vs_fastest"] == 1
    assert candidates.verdict_text(fast) == "returned mixed, 1.00x the fastest: within 5% (the fastest)"


@pytest.mark.parametrize("args, said", [
    (["--threads", "-1"], "--threads must be >= 0, got -1"),
    (["--network", "2gb"], "--network '2gb': expected a rate as tc reads it"),
    (["--network", "2gbit", "--no-measure-network"], "--no-measure-network with --network 2gbit:")])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys, args, said):
    with pytest.raises(SystemExit) as e:
        candidates.main([*args, "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
