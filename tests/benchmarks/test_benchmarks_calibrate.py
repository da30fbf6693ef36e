"""The calibration's step fit: the price of a collective from measured step times."""

import pytest

from benchmarks import calibrate


def _measured(a: float, b: float, c: float):
    """Plans whose step is exactly ``a * model + b * collectives + c``."""
    cases = [(10.0, 4), (20.0, 7), (15.0, 5), (30.0, 4), (12.0, 7), (25.0, 6)]
    plans = {f"p{i}": {"step_ms": a * m + b * n + c, "collectives": n} for i, (m, n) in enumerate(cases)}
    per_plan = [{"model_busiest_ms": m} for m, _ in cases]
    return [{"workload": "w", "plans": plans}], per_plan


def test_the_step_fit_recovers_the_price_of_a_collective():
    results, per_plan = _measured(2.0, 3.0, 10.0)
    fit = calibrate.fit_step(results, per_plan)
    assert fit["per_model_ms"] == pytest.approx(2.0, rel=1e-6)
    assert fit["per_collective_ms"] == pytest.approx(3.0, rel=1e-6)
    assert fit["collective_ms"] == pytest.approx(1.5, rel=1e-6)  # in the model's (per-rank) ms
    assert fit["rms_ms"] == pytest.approx(0.0, abs=1e-6)
    assert per_plan[1]["model_step_ms"] == pytest.approx(2.0 * 20.0 + 3.0 * 7 + 10.0)


def test_runs_without_step_times_fit_no_collective_price():
    results, per_plan = _measured(2.0, 3.0, 10.0)
    del results[0]["plans"]["p0"]["step_ms"]
    assert calibrate.fit_step(results, per_plan) is None
