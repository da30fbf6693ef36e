"""Benchmarks where bytes cost time: rates on a shaped loopback (``benchmarks/shaped_loopback.py``), their
refusals, the product benchmark's crossover rate, and one tiny product run on a shaped loopback whose results
carry the measured network and both plans."""

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import product, shaped_loopback, workloads
from benchmarks.shaped_loopback import UNSHAPED
from torchrec_hybrid.planner import NetworkMeasurement

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, rate, bits", [
    ("2gbit", "2gbit", 2e9), ("500Mbit", "500mbit", 5e8), ("1.5gbit", "1.5gbit", 1.5e9), ("8gbit", "8gbit", 8e9),
    ("100kbit", "100kbit", 1e5), ("unshaped", UNSHAPED, math.inf), ("None", UNSHAPED, math.inf)])
def test_rates_are_read_as_tc_spells_them(text, rate, bits):
    assert shaped_loopback.parse_rate("--network", text) == rate
    assert shaped_loopback.rate_bits(rate) == bits


@pytest.mark.parametrize("text", ["2gb", "2 gbit", "0gbit", "-1gbit", "gbit", "inf", "2gbps", ""])
def test_a_rate_tc_would_not_read_as_bits_is_refused_naming_the_flag_and_the_value(text):
    with pytest.raises(ValueError, match=f"--network {text!r}: expected a rate as tc reads it"):
        shaped_loopback.parse_rate("--network", text)


def test_rate_text_spells_a_rate_as_tc_would():
    assert [shaped_loopback.rate_text(b) for b in (3.1748e9, 7.5e8, 2e9, 1.2e12, 4e4, math.inf)] == [
        "3.17gbit", "750mbit", "2gbit", "1.2tbit", "40kbit", UNSHAPED]


@pytest.mark.parametrize("module", ["product", "candidates", "calibrate"])
def test_a_bad_network_rate_is_refused_before_anything_runs(tmp_path, capsys, module):
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as e:
        main(["--network", "2gb", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--network '2gb': expected a rate as tc reads it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_product_refuses_to_plan_a_shaped_run_for_an_unmeasured_network(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        product.main(["--network", "2gbit", "unshaped", "--no-measure-network", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--no-measure-network with --network 2gbit:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _fake_tools(tmp_path, monkeypatch, **scripts):
    """A PATH holding only bash and the given tools (name -> shell script body)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "bash").symlink_to("/bin/bash")
    for name, body in scripts.items():
        tool = bindir / name
        tool.write_text("#!/bin/bash\n" + body + "\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bindir))


@pytest.mark.parametrize("module", ["product", "candidates", "calibrate"])
def test_a_missing_tool_is_named_with_its_package_and_exits_2(tmp_path, monkeypatch, capsys, module):
    import importlib

    _fake_tools(tmp_path, monkeypatch, ip="exit 0")  # no unshare, no tc
    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit) as e:
        main(["--network", "2gbit", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--network 2gbit: missing unshare (util-linux), tc (iproute2): install them" in err
    assert not (tmp_path / "out").exists()


def test_a_namespace_that_cannot_be_made_is_said_with_its_own_error(tmp_path, monkeypatch, capsys):
    _fake_tools(tmp_path, monkeypatch, ip="exit 0", tc="exit 0",
                unshare='echo "unshare: unshare failed: Operation not permitted" >&2; exit 1')
    assert "unshare failed: Operation not permitted (user namespaces disabled?" in shaped_loopback.unavailable()
    with pytest.raises(SystemExit) as e:
        product.main(["--network", "500mbit", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert ("--network 500mbit: could not make a network namespace with a shaped loopback: unshare: unshare failed: "
            "Operation not permitted") in capsys.readouterr().err


def _ci(ratio, half=0.02):
    return (ratio - half, ratio, ratio + half)


def test_the_crossover_is_interpolated_on_log_rate_where_the_ratio_crosses_one():
    # given out of order: sorted by rate, 0.9x at 2gbit and 1.2x at 8gbit cross a third of the way in log rate
    c = product.crossover([("8gbit", _ci(1.2)), ("500mbit", _ci(0.8)), ("2gbit", _ci(0.9))])
    assert [p["rate"] for p in c["points"]] == ["500mbit", "2gbit", "8gbit"]
    assert c["rate_bits_per_s"] == pytest.approx(2e9 * 4 ** (1 / 3))
    assert c["stock_faster"] == "above"
    assert c["text"] == "~3.17gbit (2gbit 0.90x, 8gbit 1.20x)"


def test_a_ratio_on_one_side_of_one_at_every_rate_has_no_crossover_inside_the_rates_run():
    stock = product.crossover([("500mbit", _ci(1.1)), ("2gbit", _ci(1.3)), (UNSHAPED, _ci(1.5))])
    assert stock["rate_bits_per_s"] is None and stock["stock_faster"] == "at every rate"
    assert stock["text"].startswith("below all rates run (the stock plan stepped faster at every rate, 500mbit to "
                                    "unshaped)")
    hybrid = product.crossover([("500mbit", _ci(0.5)), ("8gbit", _ci(0.99))])
    assert hybrid["rate_bits_per_s"] is None and hybrid["stock_faster"] == "at no rate"
    assert hybrid["text"].startswith("above all rates run")
    assert product.crossover([("2gbit", _ci(0.7))])["text"] == "one rate run: no crossover"


def test_a_crossover_next_to_the_unshaped_loopback_and_the_noisy_ones_say_so():
    unshaped = product.crossover([("2gbit", _ci(0.8)), (UNSHAPED, _ci(1.1))])
    assert unshaped["rate_bits_per_s"] is None and unshaped["stock_faster"] == "above"
    assert unshaped["text"] == "between 2gbit and unshaped (2gbit 0.80x, unshaped 1.10x)"
    # the last crossing counts; a neighbour's interval holding 1.0 leaves it unresolved
    noisy = product.crossover([("500mbit", _ci(0.9)), ("1gbit", _ci(1.05)), ("2gbit", _ci(0.95, 0.1)),
                               ("4gbit", _ci(1.2))])
    assert noisy["rate_bits_per_s"] == pytest.approx(math.exp(math.log(2e9) + 0.2 * math.log(2)))
    assert noisy["text"].endswith("; unresolved: an interval there holds 1.0; the ratio crosses 1.0 3 times over "
                                  "the rates run")
    # the stock plan faster where bytes are slow, the hybrid where they are fast: no rate above which stock wins
    down = product.crossover([("1gbit", _ci(1.2)), ("4gbit", _ci(0.8))])
    assert down["stock_faster"] == "below" and down["rate_bits_per_s"] == pytest.approx(2e9)
    assert down["text"] == "none: the stock plan stepped faster below ~2gbit, the hybrid plan above it (1gbit 1.20x, " \
                           "4gbit 0.80x)"


def test_crossovers_group_the_results_by_workload_world_and_plan():
    def result(workload, world, rate, ratios):
        return {"workload": workload, "world": world, "network": {"rate": rate},
                "ratios": {m: {"paired_step_ci": _ci(x)} for m, x in zip(workloads.HYBRID_MODELS, ratios)}}

    results = [result("onehot", 2, "1gbit", (0.5, 0.8)), result("multihot", 2, "1gbit", (1.1, 1.2)),
               result("onehot", 2, "4gbit", (1.5, 0.9)), result("multihot", 2, "4gbit", (1.3, 1.4))]
    got = {(c["workload"], c["plan"]): c for c in product.crossovers(results)}
    assert len(got) == 4 and all(c["world"] == 2 for c in got.values())
    assert got["onehot", "hybrid_planner"]["rate_bits_per_s"] == pytest.approx(1e9 * 4 ** 0.5)
    assert got["onehot", "hybrid_planner_bytes"]["stock_faster"] == "at no rate"
    assert got["multihot", "hybrid_planner"]["stock_faster"] == "at every rate"


def test_the_network_record_gives_the_measured_bandwidths_in_the_asked_rates_unit():
    measured = NetworkMeasurement(4, 62_500.0, 31_250.0, 0.3, "gloo", all_to_all_samples=((4096, 1e-3),))
    rec = shaped_loopback.network_record("2gbit", measured, 4)
    assert rec["rate"] == "2gbit" and rec["rate_bits_per_s"] == 2e9
    m = rec["measured"]
    assert m["per_rank_gbit_s"] == pytest.approx(0.5)  # 62,500 bytes/ms = 62.5 MB/s = 0.5 Gbit/s
    assert m["aggregate_gbit_s"] == pytest.approx(2.0) and m["allreduce_gbit_s"] == pytest.approx(0.25)
    assert m["collective_ms"] == 0.3 and m["all_to_all_samples"] == ((4096, 1e-3),) and m["backend"] == "gloo"
    assert shaped_loopback.network_record(UNSHAPED, None, 4) == {"rate": UNSHAPED, "rate_bits_per_s": None,
                                                                 "measured": None}


def test_product_on_a_shaped_loopback(tmp_path):
    """W=2 on a loopback shaped to 2gbit: the module re-runs itself in the namespace; the results file in --out
    carries that run's result with the measured network (about the asked rate: the plain loopback measures several
    times more here), both plans and the network tables; the same results unshaped and unmeasured print as before."""
    reason = shaped_loopback.unavailable("2gbit")
    if reason:
        pytest.skip(f"no shaped loopback here: {reason}")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.product", "--world", "2", "--rows-cap", "2000",
                           "--steps", "3", "--warmup", "1", "--stats-batches", "2", "--workloads", "onehot",
                           "--network", "2gbit", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != shaped_loopback.ENV})
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "product.json").read_text())
    assert (tmp_path / "network-2gbit" / "product.json").exists()  # the shaped process's own file
    (r,) = data["results"]
    assert data["args"]["network"] == ["2gbit"] and r["workload"] == "onehot" and r["world"] == 2
    net = r["network"]
    assert net["rate"] == "2gbit" and net["rate_bits_per_s"] == 2e9
    m = net["measured"]
    assert m["world_size"] == 2 and m["backend"] == "gloo" and m["collective_ms"] >= 0  # a token bucket's burst: 0
    assert m["aggregate_gbit_s"] == pytest.approx(2 * m["per_rank_gbit_s"])
    assert 0.2 < m["aggregate_gbit_s"] < 4.0, m  # shaped: a token bucket at 2 Gbit/s for all ranks together
    for plan in workloads.MODELS:
        assert sum(r["types"][plan].values()) == 26, plan  # every table placed, by each planner
        assert r[plan]["mean_bytes"] > 0 and r[plan]["median_step_s"] > 0
    for plan, q in r["ratios"].items():
        assert q["busiest"] == pytest.approx(r[plan]["busiest_bytes"] / r["stock_planner"]["busiest_bytes"])
        lo, mid, hi = q["paired_step_ci"]
        assert 0 < lo <= mid <= hi
    (c, _) = data["crossover"]
    assert c["text"] == "one rate run: no crossover"
    md = (tmp_path / "product.md").read_text()
    gbit = shaped_loopback.gbit
    assert f"| 2gbit | onehot | 2 | {gbit(m['per_rank_gbit_s'])} | {gbit(m['aggregate_gbit_s'])} |" in md
    s = r["stock_planner"]
    assert (f"| 2gbit | onehot | 2 | stock_planner | {workloads.types_text(r['types']['stock_planner'])} | "
            f"{s['mean_bytes'] / 1e6:.2f} / {s['busiest_bytes'] / 1e6:.2f} | 1 | {s['median_step_s'] * 1e3:.1f} | - |"
            in md)
    assert "crossover onehot" not in proc.stderr  # one rate: the terminal summary has ratios, no crossover lines
    assert f"onehot W=2 hybrid_planner [2gbit, measured {gbit(m['aggregate_gbit_s'])} Gbit/s all ranks]: " \
           f"busiest bytes {r['ratios']['hybrid_planner']['busiest']:.2f}x" in proc.stderr
    plain = dict(r, network=shaped_loopback.network_record(UNSHAPED, None, 2))
    lines = product.markdown([plain])
    assert lines[0].startswith("| workload | W | plan |") and not any(line.startswith("## ") for line in lines)
