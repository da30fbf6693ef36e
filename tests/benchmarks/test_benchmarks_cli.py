"""`python -m benchmarks` flags: overrides reach every configuration, bad values are refused naming
flag and value, output goes outside the committed results by default, plots stay readable (issue 17)."""

import os

import matplotlib.pyplot as plt
import pytest

from benchmarks import plots
from benchmarks.config import PLANNER_TYPES, SHARDING_TYPES, apply_overrides, hot_row_sweep, mode_workloads
from benchmarks.run import DEFAULT_OUT, RESULTS, build_parser, overrides_of, plan_run


def test_default_output_is_not_the_committed_results():
    a = build_parser().parse_args([])
    assert a.out == DEFAULT_OUT == os.path.join("out", "benchmarks")
    assert os.path.abspath(a.out) != RESULTS and overrides_of(a) == {}


@pytest.mark.parametrize("flag, value", [
    ("--world", "1"), ("--world", "x"), ("--batch", "0"), ("--rows-cap", "0"), ("--dim", "12"), ("--dim", "0"),
    ("--alpha", "-1"), ("--alpha", "inf"), ("--steps", "0"), ("--warmup", "-1"), ("--hot-rows", "-5"),
    ("--model", "mlp"),
])
def test_bad_values_are_refused_naming_flag_and_value(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--tiny", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and value in err, err


def test_overrides_reach_every_configuration():
    a = build_parser().parse_args(["--tiny", "--world", "2", "3", "--batch", "32", "--rows-cap", "500", "--dim", "32",
                                   "--alpha", "1.2", "--multi-hot", "--steps", "2", "--warmup", "0",
                                   "--hot-rows", "50"])
    ov = overrides_of(a)
    assert ov == {"world": [2, 3], "batch_per_rank": 32, "rows_cap": 500, "dim": 32, "alpha": [1.2],
                  "multi_hot": True, "hot_rows": 50, "steps": 2, "warmup": 0}
    main_w, sweep_w = plan_run("tiny", ov)
    # tiny's ebc Zipf 1.1 / ebc uniform / dlrm become ebc and dlrm at Zipf 1.2, multi-hot: 2 per world size
    assert [(w.world, w.model) for w in main_w] == [(2, "ebc"), (3, "ebc"), (2, "dlrm"), (3, "dlrm")]
    for w in main_w:
        assert (w.batch_per_rank, w.rows_cap, w.dim, w.alpha, w.multi_hot, w.steps, w.warmup, w.hot_rows) == \
            (32, 500, 32, 1.2, True, 2, 0, 50)
        assert w.types == (SHARDING_TYPES if w.model == "ebc" else SHARDING_TYPES + PLANNER_TYPES)
    # the sweep takes the first world size and keeps varying the hot-set size
    assert [w.hot_rows for w in sweep_w] == [w.hot_rows for w in hot_row_sweep("tiny")]
    assert {(w.world, w.dim, w.alpha, w.multi_hot) for w in sweep_w} == {(2, 32, 1.2, True)}


def test_world_overrides_leave_the_one_gpu_runs_at_one_rank():
    """The CUDA configurations run on one GPU: --world sets the gloo world size of the others only (each
    rank would take cuda:<rank>)."""
    main_w, _ = plan_run("tiny", {"world": [2, 4]}, cuda=True)
    assert sorted({(w.world, w.device) for w in main_w}) == [(1, "cuda"), (2, "cpu"), (4, "cpu")]


def test_headline_refuses_several_values_of_a_flag(capsys):
    """--headline reports one configuration: --world 2 4 would measure both and report only the first."""
    from benchmarks.run import main

    with pytest.raises(SystemExit) as e:
        main(["--headline", "--world", "2", "4"])
    assert e.value.code == 2
    assert "--world got several values [2, 4]" in capsys.readouterr().err


def test_no_overrides_keep_the_modes():
    for mode in ("tiny", "quick", "full", "headline"):
        assert plan_run(mode, {}) == (mode_workloads(mode), hot_row_sweep(mode))
    with pytest.raises(ValueError, match="dim must be a multiple of 8.*got 12"):
        apply_overrides(mode_workloads("tiny"), {"dim": 12})


def _result(w, alpha):
    rs = {k: {"bytes_per_rank_per_step": (i + 1) * 1e5 * (1 + alpha), "expected_bytes_per_rank_per_step": 1e5}
          for i, k in enumerate(SHARDING_TYPES)}
    return {"workload": {**w.as_dict(), "alpha": alpha}, "results": rs,
            "hot_set": {"hot_rows_total": w.hot_rows}}


def test_plots_have_at_most_eight_series_and_labelled_log_axes(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    base = mode_workloads("quick")[0]
    results = [_result(base, a) for a in (0.0, 1.05, 1.1, 1.2)]
    assert plots.bytes_vs_alpha(results, str(tmp_path / "a.png"))
    sweep = [{**_result(w, 1.1), "results": {"frequency_hybrid": _result(w, 1.1)["results"]["frequency_hybrid"]}}
             for w in hot_row_sweep("quick")]
    assert plots.bytes_vs_hot_rows(sweep, results[2], str(tmp_path / "h.png"))
    monkeypatch.undo()
    assert len(figs) == 2
    for fig in figs:
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            lines = ax.get_lines()
            assert 0 < len(lines) <= plots.MAX_SERIES
            styles = [(ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in lines]
            assert len(set(styles)) == len(styles)  # no two series look alike
            for axis, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
                if getattr(ax, f"get_{axis}scale")() == "log":
                    assert "log" in label, label
        plt.close(fig)
    assert (tmp_path / "a.png").stat().st_size > 1000 and (tmp_path / "h.png").stat().st_size > 1000


def test_the_product_benchmark_refuses_a_bad_prices_file_before_starting_ranks(tmp_path):
    from benchmarks import product

    bad = tmp_path / "prices.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="prices.json: not a calibration file"):
        product.main(["--prices", str(bad), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "product.json").exists()


@pytest.mark.parametrize("module, args, words", [
    ("product", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("product", ["--world", "4", "1"], "--world must be >= 2, got 1"),
    ("product", ["--rows-cap", "0"], "--rows-cap must be >= 1, got 0"),
    ("simulate", ["--alpha", "nan"], "--alpha must be a finite Zipf exponent >= 0, got nan"),
    ("simulate", ["--samples", "-5"], "--samples must be >= 1, got -5"),
    ("run", ["--tiny", "--no-simulate"], "--no-simulate: the tiny mode runs no projection"),
    ("run", ["--headline", "--no-simulate"], "--no-simulate: the headline mode runs no projection"),
])
def test_benchmark_flags_that_cannot_apply_are_refused_before_anything_runs(tmp_path, capsys, module, args, words):
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    with pytest.raises(SystemExit):
        main(args + ["--out", str(tmp_path / "out")])
    assert words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_headline_with_overrides_keeps_its_ratios_and_records_the_overrides(tmp_path, monkeypatch):
    """--headline measures one configuration; with an override it is no longer the acceptance one, but its ratios
    still come out, with the overrides beside them (the committed run's measurement stands in for a new one)."""
    import copy
    import json

    from benchmarks import run

    with open("benchmarks/results/headline.json") as f:
        committed = json.load(f)["configurations"][0]

    def measure(workloads):  # the run's own configuration, with the committed measurement
        assert len(workloads) == 1 and workloads[0].steps == 10
        r = copy.deepcopy(committed)
        r["workload"] = workloads[0].as_dict()
        return [r]

    monkeypatch.setattr(run, "measure", measure)
    monkeypatch.setattr(run, "_plots", lambda *a, **k: {})
    doc = run.main(["--headline", "--steps", "10", "--out", str(tmp_path)])
    assert doc["headline"]["overrides"] == {"steps": 10}
    assert doc["headline"]["time_hybrid_over_fastest_stock"] == committed["ratios"]["time_hybrid_over_fastest_stock"]
    assert json.loads((tmp_path / "headline.json").read_text())["headline"]["overrides"] == {"steps": 10}


def test_projection_picks_the_top_rows_by_lookups_not_by_table():
    """The large-cluster projection's fixed hot set is the most looked-up rows: a table whose bags hold
    100 ids takes rows over one-id tables of the same law (it used to get an equal share), and its cold
    fraction is a share of all lookups, each table weighted by its ids per bag."""
    import torch

    from benchmarks.simulate import global_top

    gains = torch.linspace(0.02, 0.001, 50, dtype=torch.float64)  # each row less popular than the one before
    cov = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(gains, 0)])
    assert global_top([cov, cov], 20) == [10, 10]
    assert global_top([cov, cov], 20, [1, 100]) == [0, 20]
