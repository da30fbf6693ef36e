"""`python -m benchmarks.tbe_paths` at a tiny size: both layouts timed on the same bags, the slopes
and their share written to results files (what cost_model.VIRTUAL_BACKWARD_EXTRA is read from)."""

import json

from benchmarks import tbe_paths


def test_tbe_paths_tiny(tmp_path):
    r = tbe_paths.main(["--ids", "64", "256", "--rows", "1000", "--dim", "8", "--repeats", "3",
                        "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "tbe_paths.json").read_text())
    assert saved["extra_share"] == r["extra_share"]
    assert [run["ids"] for run in saved["runs"]] == [64, 256]
    for run in saved["runs"]:
        assert set(run["layouts"]) == {"one feature", "4 virtual features"}
        assert all(t["forward_ms"] > 0 and t["backward_ms"] > 0 for t in run["layouts"].values())
    # the share is the ratio of the two least-squares slopes over the sizes
    ids = [float(run["ids"]) for run in saved["runs"]]
    extra = tbe_paths.slope(ids, [run["extra_ms"] for run in saved["runs"]])
    assert abs(saved["extra_share"] - extra / tbe_paths.slope(ids, [run["lookup_ms"] for run in saved["runs"]])) < 1e-12
    assert "extra share" in (tmp_path / "tbe_paths.md").read_text()


def test_slope_is_least_squares():
    assert tbe_paths.slope([0.0, 1.0, 2.0], [1.0, 3.0, 5.0]) == 2.0
