"""The calibration's step fit: how a step follows the busiest and the mean rank, and the price of a collective."""

import pytest

from benchmarks import calibrate

# (busiest-rank model ms, mean-rank model ms, collectives) of some plans
CASES = [(10.0, 8.0, 4), (20.0, 12.0, 7), (15.0, 14.0, 5), (30.0, 18.0, 4), (12.0, 6.0, 7), (25.0, 24.0, 6),
         (18.0, 9.0, 5)]


def _measured(a: float, m: float, b: float, c: float):
    """Plans whose step is exactly ``a * busiest + m * mean + b * collectives + c``."""
    plans = {f"p{i}": {"step_ms": a * hi + m * mean + b * n + c, "collectives": n}
             for i, (hi, mean, n) in enumerate(CASES)}
    per_plan = [{"model_busiest_ms": hi, "model_mean_ms": mean} for hi, mean, _ in CASES]
    return [{"workload": "w", "plans": plans}], per_plan


def test_the_step_fit_recovers_the_busiest_share_and_the_price_of_a_collective():
    results, per_plan = _measured(0.5, 1.5, 3.0, 10.0)
    fit = calibrate.fit_step(results, per_plan)
    assert fit["busiest_share"] == pytest.approx(0.25, rel=1e-6)
    assert fit["collective_ms"] == pytest.approx(1.5, rel=1e-6)  # in the model's (per-rank) ms: 3 / (0.5 + 1.5)
    assert fit["rms_ms"] == pytest.approx(0.0, abs=1e-6)
    assert per_plan[1]["model_step_ms"] == pytest.approx(0.5 * 20.0 + 1.5 * 12.0 + 3.0 * 7 + 10.0)
    one_rank_per_device = calibrate.fit_step(*_measured(2.0, 0.0, 0.0, 5.0))
    assert one_rank_per_device["busiest_share"] == pytest.approx(1.0) and one_rank_per_device["collective_ms"] == 0


def test_runs_without_step_times_fit_neither():
    results, per_plan = _measured(1.0, 1.0, 3.0, 10.0)
    del results[0]["plans"]["p0"]["step_ms"]
    assert calibrate.fit_step(results, per_plan) is None


@pytest.mark.parametrize("extra, words", [
    (["--steps", "5"], "--steps: set how to measure, but --refit measures nothing"),
    (["--world", "2"], "--world: set how to measure"),
])
def test_refit_refuses_measuring_flags(tmp_path, capsys, extra, words):
    from benchmarks.calibrate import main

    with pytest.raises(SystemExit):
        main(["--refit", "benchmarks/results/calibration.json", "--out", str(tmp_path / "c")] + extra)
    assert words in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_refit_of_a_file_without_measurements_names_it(tmp_path, capsys):
    from benchmarks.calibrate import main

    with pytest.raises(SystemExit):
        main(["--refit", "benchmarks/results/product_w4.json", "--out", str(tmp_path / "c")])
    assert "--refit benchmarks/results/product_w4.json: not a calibration results file" in capsys.readouterr().err


def test_refit_reports_the_runs_world(tmp_path):
    import json

    from benchmarks.calibrate import main

    main(["--refit", "benchmarks/results/calibration.json", "--out", str(tmp_path / "c")])
    with open("benchmarks/results/calibration.json") as f:
        world = json.load(f)["args"]["world"]
    assert f"({world} gloo ranks" in (tmp_path / "c.md").read_text()
