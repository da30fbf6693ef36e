"""Hot-set refresh in the DLRM example (sharding.refresh, data.drift): 2 gloo ranks, tiny config."""

import json
import math
import re

import pytest
import torch

from examples.dlrm.config import ConfigError, config_from_args, load_config
from examples.dlrm.data import SyntheticCriteoBatches, build_data
from examples.dlrm.refresh import HOT_SETS_FILE, STATS_FILE, load_hot_sets
from torchrec_hybrid.stats import HotSetCoverage
from torchrec_hybrid.stats.synthetic import criteo_table_sizes

from tests.examples.test_dlrm_example import TINY, run_train

SIZES = criteo_table_sizes(scale=0.001)
N = 8
DRIFT = ["--set", "data.drift_rows=3"]


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_drifting_synthetic_data():
    plain = SyntheticCriteoBatches(SIZES, 4096)
    drift = SyntheticCriteoBatches(SIZES, 4096, drift_rows=50)
    # batch 0 is the stream without drift; later batches follow the rotated ranking
    assert torch.equal(plain.batch(0).sparse_features.values(), drift.batch(0).sparse_features.values())
    f = "cat_2"
    for i in (0, 7):
        ids = drift.batch(i).sparse_features[f].values()
        top = drift.top_ids(i, 3)[f]
        assert int(torch.mode(ids).values) in top.tolist()
    assert not torch.equal(drift.top_ids(0, 20)[f], drift.top_ids(7, 20)[f])
    with pytest.raises(ValueError):
        SyntheticCriteoBatches(SIZES, 8, drift=0.1, drift_rows=1.0)


@pytest.mark.parametrize("override, words", [
    ("sharding.refresh.decay=0", ["sharding.refresh.decay", "(0, 1]"]),
    ("sharding.refresh.min_coverage=1.5", ["sharding.refresh.min_coverage"]),
    ("sharding.refresh.every=-1", ["sharding.refresh.every", ">= 0"]),
    ("sharding.refresh.often=1", ["sharding.refresh.often", "min_coverage"]),
    ("data.drift=2", ["data.drift", "[0, 1]"]),
    ("data.drift_mode=sideways", ["data.drift_mode", "'rise'"]),
])
def test_bad_refresh_config_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(ConfigError, match="give one of them"):
        load_config(TINY, ["data.drift=0.1", "data.drift_rows=1"])


def test_refreshed_run_trains_like_the_stock_plan(tmp_path):
    """Refreshing the hot sets (every 2 steps and on low coverage) moves no weights: the
    per-step losses equal those of the same run under TorchRec's stock plan."""
    hyb, stock = tmp_path / "hybrid.jsonl", tmp_path / "stock.jsonl"
    out, err = run_train("--steps", str(N), *DRIFT, "--set", "sharding.refresh.every=2",
                         "--set", "sharding.refresh.min_coverage=0.99", "--set", "sharding.refresh.window=1",
                         "--set", f"metrics.jsonl={hyb}", "--set", "train.log_level=info",
                         "--set", "train.log_every=4")
    assert out["refreshes"] >= N // 2 and out["hot_ids_changed"] > 0, out
    assert out["refresh_bytes"] > 0 and out["refresh_s"] > 0 and 0 < out["coverage"] <= 1
    assert "hot-set refresh (every 2 steps)" in err and "hot-set refresh (coverage" in err
    assert re.search(r"step 4 loss .* coverage 0\.\d+", err), err[-2000:]
    out_s, _ = run_train("--steps", str(N), *DRIFT, "--planner", "stock", "--set", f"metrics.jsonl={stock}")
    a, b = _jsonl(hyb), _jsonl(stock)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, N + 1))
    for x, y in zip(a, b):
        assert math.isfinite(x["loss"]) and x["loss"] == pytest.approx(y["loss"], rel=1e-3), (x, y)
        assert 0 < x["coverage"] <= 1 and x["bytes"] > 0
        assert y["coverage"] is None
    assert out_s["refreshes"] == 0 and out_s["coverage"] is None


def test_resume_continues_with_the_refreshed_hot_sets(tmp_path):
    """A checkpoint written right after a refresh carries the new hot sets, the ones the next batch
    was already split by, and (asked) the statistics: the resumed run gives the uninterrupted run's
    losses and coverage bit for bit and picks the same hot sets at the next refresh; the checkpoint
    also resumes under the stock planner."""
    common = [*DRIFT, "--set", "sharding.refresh.every=4", "--set", "checkpoint.stats=true",
              "--set", "checkpoint.every=4", "--set", "metrics.validation_batches=0",
              "--set", "sharding.stats.batches=1"]
    full_dir, full_log = tmp_path / "full", tmp_path / "full.jsonl"
    run_train("--steps", str(N), *common, "--checkpoint-dir", str(full_dir), "--set", f"metrics.jsonl={full_log}")
    ckpt, part = tmp_path / "ckpt", tmp_path / "part.jsonl"
    first, _ = run_train("--steps", str(N // 2), *common, "--checkpoint-dir", str(ckpt),
                         "--set", f"metrics.jsonl={part}")
    assert first["refreshes"] == 1 and first["hot_ids_changed"] > 0
    step_dir = ckpt / f"step_{N // 2}"
    assert (step_dir / HOT_SETS_FILE).exists() and (step_dir / STATS_FILE).exists()
    saved, reference = load_hot_sets(str(step_dir)), load_hot_sets(str(full_dir / f"step_{N // 2}"))
    assert saved.keys() == reference.keys() and all(torch.equal(saved[k], reference[k]) for k in saved)

    stock_ckpt = tmp_path / "stock_ckpt"
    import shutil

    shutil.copytree(ckpt, stock_ckpt)
    out, err = run_train("--steps", str(N), *common, "--checkpoint-dir", str(ckpt), "--resume",
                         "--set", f"metrics.jsonl={part}", "--set", "train.log_level=info")
    assert out["start_step"] == N // 2 and out["step"] == N
    m = re.search(r"hot sets of \d+ hybrid table\(s\) from .* \((\d+) ids differ from the planned ones\)", err)
    assert m and int(m.group(1)) > 0, err[-3000:]
    assert "refresh statistics from" in err
    full, resumed = _jsonl(full_log), _jsonl(part)
    assert [r["step"] for r in resumed] == list(range(1, N + 1))
    # bit for bit: every batch is split by the hot sets it was split by in the uninterrupted run; the first
    # resumed one by the sets before the refresh at the checkpoint's step (its input dist ran a step early
    # there), stored beside the refreshed ones
    for x, y in zip(full[N // 2:], resumed[N // 2:]):
        assert y["loss"] == x["loss"] and y["coverage"] == x["coverage"], (x, y)
    in_flight = load_hot_sets(str(step_dir), in_flight=True)
    assert in_flight is not None and not all(torch.equal(in_flight[k], saved[k]) for k in saved)
    cfg = config_from_args(["--config", TINY, *common, "--checkpoint-dir", str(ckpt)])
    hits = lookups = 0
    for rank in range(2):
        source, tables = build_data(cfg, rank, 2)
        h, n = HotSetCoverage(tables, in_flight).counts(source.batch(N // 2).sparse_features)
        hits, lookups = hits + int(h.sum()), lookups + int(n.sum())
    assert resumed[N // 2]["coverage"] == pytest.approx(hits / lookups, rel=1e-12)
    # the refresh at step N, from the restored statistics, picks what the uninterrupted run picked
    a, b = load_hot_sets(str(full_dir / f"step_{N}")), load_hot_sets(str(ckpt / f"step_{N}"))
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], saved[k]) for k in a)

    out, err = run_train("--steps", str(N // 2 + 2), *common, "--planner", "stock", "--checkpoint-dir",
                         str(stock_ckpt), "--resume", "--set", "train.log_level=warning")
    assert out["step"] == N // 2 + 2 and "WARNING" not in err, err[-3000:]
