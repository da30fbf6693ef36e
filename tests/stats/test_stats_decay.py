"""FrequencyStats decay: math against a reference recomputed from the same batches, the
``decay`` option, sketches, merging and save/load of decayed (float) statistics (issue 19)."""

import numpy as np
import pytest
import torch
from stats_testutils import feature_values, one_feature_kjts, random_kjt, table, zipf_stream

from torchrec_hybrid.stats import CountMinTopK, FrequencyStats, select_hot_ids
from torchrec_hybrid.stats.persistence import state_checksum

TABLES = [table("small", 50, ["f_a", "f_b"]),  # two features share a table
          table("medium", 3000, ["f_c"]),
          table("large", 20_000, ["f_d"])]  # sketched below
ROWS = {"f_a": 50, "f_b": 50, "f_c": 3000, "f_d": 20_000, "f_unknown": 10**9}
FEATURE_TABLE = {"f_a": "small", "f_b": "small", "f_c": "medium", "f_d": "large"}
KW = dict(exact_max_rows=5000, sketch_capacity=300, sketch_eps=1e-2)
FACTORS = [0.9, 0.5, 1.0, 0.75, 0.3, 0.99, 0.6]


def stream(seed, batches=len(FACTORS)):
    rng = np.random.default_rng(seed)
    return [random_kjt(rng, ROWS, batch=int(rng.integers(1, 200))) for _ in range(batches)]


def reference(kjts, factors):
    """Decayed counts, lookups and samples from first principles: before batch i every earlier
    count is multiplied by factors[i] (numpy float64, one bincount per feature and batch)."""
    counts = {t.name: np.zeros(t.num_embeddings) for t in TABLES}
    lookups = {t.name: 0.0 for t in TABLES}
    samples = 0.0
    for kjt, f in zip(kjts, factors):
        for name in counts:
            counts[name] *= f
            lookups[name] *= f
        samples = samples * f + kjt.stride()
        for feat, v in feature_values(kjt).items():
            if feat in FEATURE_TABLE:
                name = FEATURE_TABLE[feat]
                counts[name] += np.bincount(v, minlength=counts[name].size)
                lookups[name] += v.size
    return counts, lookups, samples


def decayed_sketch_table(kjts, factors):
    """The sketch is linear: its decayed table is the factor-weighted sum of one sketch per batch."""
    stats = FrequencyStats(TABLES, **KW)
    ref = torch.zeros_like(stats.sketch("large").table, dtype=torch.float64)
    for kjt, f in zip(kjts, factors):
        one = FrequencyStats(TABLES, **KW)
        one.update(kjt)
        ref = ref * f + one.sketch("large").table.to(torch.float64)
    return ref


def check_against_reference(stats, kjts, factors):
    counts, lookups, samples = reference(kjts, factors)
    for name in ("small", "medium"):
        assert stats.counts(name).dtype == torch.float64
        np.testing.assert_allclose(stats.counts(name).numpy(), counts[name], rtol=1e-12, atol=1e-12)
    for name in stats.table_names:
        assert stats.lookups(name) == pytest.approx(lookups[name], rel=1e-12)
    assert stats.num_samples == pytest.approx(samples, rel=1e-12)
    assert stats.num_batches == len(kjts)  # batches seen are not decayed
    torch.testing.assert_close(stats.sketch("large").table, decayed_sketch_table(kjts, factors),
                               rtol=1e-12, atol=1e-12)
    # Count-Min still never underestimates the (decayed) count; candidates in count order
    ids, est = stats.top_counts("large")
    true = torch.from_numpy(counts["large"])[ids]
    assert (est >= true * (1 - 1e-12)).all()
    assert (est[:-1] >= est[1:]).all()


def test_decay_between_batches_matches_reference():
    kjts = stream(0)
    stats = FrequencyStats(TABLES, **KW)
    for kjt, f in zip(kjts, FACTORS):
        stats.decay_(f)
        stats.update(kjt)
    check_against_reference(stats, kjts, FACTORS)


def test_decay_option_equals_decay_before_each_update():
    kjts = stream(1)
    auto = FrequencyStats(TABLES, decay=0.8, **KW)
    for kjt in kjts:
        auto.update(kjt)
    check_against_reference(auto, kjts, [0.8] * len(kjts))


def test_counts_stay_int64_and_exact_until_decayed():
    kjts = stream(2)
    plain, unit = FrequencyStats(TABLES, **KW), FrequencyStats(TABLES, **KW)
    for kjt in kjts:
        plain.update(kjt)
        unit.decay_(1.0)  # a factor of 1 changes nothing, not even the dtype
        unit.update(kjt)
    assert not unit.is_float and unit.counts("small").dtype == torch.int64
    assert state_checksum(unit.state_dict()) == state_checksum(plain.state_dict())
    assert isinstance(unit.lookups("small"), int) and isinstance(unit.num_samples, int)
    for bad in (0, -0.5, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="decay factor"):
            plain.decay_(bad)
    with pytest.raises(ValueError, match="decay factor"):
        FrequencyStats(TABLES, decay=0.0)


def test_tiny_factors_renormalise_without_overflow():
    """The running scale is folded into the counters before it underflows."""
    kjts = stream(3, batches=4)
    factors = [1.0, 1e-80, 1e-90, 1e-70]  # running scale 1e-240 without folding
    stats = FrequencyStats(TABLES, **KW)
    for kjt, f in zip(kjts, factors):
        stats.decay_(f)
        stats.update(kjt)
    assert stats._scale >= 1e-150
    check_against_reference(stats, kjts, factors)


def test_decayed_selection_prefers_recent_ids():
    old, new = torch.arange(0, 10).repeat(50), torch.arange(10, 20).repeat(10)
    stats = FrequencyStats([table("t", 100, ["f"])])
    stats.update(one_feature_kjts(old, "f", old.numel())[0])
    for _ in range(20):
        stats.decay_(0.7)
    stats.update(one_feature_kjts(new, "f", new.numel())[0])
    hot = select_hot_ids(stats, rows_per_table=10)["t"]
    assert hot.tolist() == list(range(10, 20))  # 500 old lookups * 0.7**20 < 100 new
    ids, counts = stats.top_counts("t")
    assert ids.numel() == 20 and counts[-1] == pytest.approx(50 * 0.7**20, rel=1e-12)  # old ids fade
    share = stats.hot_share({"t": hot})["t"]
    assert share == pytest.approx(100 / (100 + 500 * 0.7**20), rel=1e-12)


def test_standalone_sketch_decay_keeps_invariants():
    ids = zipf_stream(10_000, 40_000, 1.2, seed=4)
    sk = CountMinTopK(10_000, 100, eps=1e-3, delta=0.05)
    true = torch.zeros(10_000, dtype=torch.float64)
    for part in ids.split(5_000):
        sk.decay_(0.9)
        true *= 0.9
        sk.update(part)
        true += torch.bincount(part, minlength=10_000)
    assert sk.table.dtype == torch.float64
    assert (sk.estimate(torch.arange(10_000)) >= true * (1 - 1e-12)).all()
    found, est = sk.top(20)
    assert set(found.tolist()) == set(torch.sort(true, descending=True, stable=True).indices[:20].tolist())
    assert torch.equal(est, sk.estimate(found))
    with pytest.raises(ValueError, match="float counters"):
        CountMinTopK(100, 10, eps=0.1).update(torch.tensor([1, 2]), weight=0.5)


def test_merge_of_decayed_and_plain_statistics():
    a_kjts, b_kjts = stream(5), stream(6)
    a, b = FrequencyStats(TABLES, **KW), FrequencyStats(TABLES, **KW)
    for kjt, f in zip(a_kjts, FACTORS):
        a.decay_(f)
        a.update(kjt)
    for kjt in b_kjts:
        b.update(kjt)
    m = FrequencyStats.merged(b, a)  # int + float -> float
    assert m.is_float and not b.is_float
    ca, _, _ = reference(a_kjts, FACTORS)
    cb, _, _ = reference(b_kjts, [1.0] * len(b_kjts))
    np.testing.assert_allclose(m.counts("medium").numpy(), ca["medium"] + cb["medium"], rtol=1e-12)
    assert m.lookups("large") == pytest.approx(a.lookups("large") + b.lookups("large"), rel=1e-12)
    assert m.num_batches == a.num_batches + b.num_batches


def _decayed(seed=7):
    stats = FrequencyStats(TABLES, decay=0.9, **KW)
    for kjt in stream(seed):
        stats.update(kjt)
    stats.decay_(0.5)  # a pending scale: save must fold it in
    return stats


def test_decayed_save_load_round_trip(tmp_path):
    stats = _decayed()
    path = tmp_path / "decayed.pt"
    stats.save(path)
    raw = torch.load(path, weights_only=True)
    assert raw["count_dtype"] == "float64" and raw["decay"] == 0.9 and raw["merged"] is False
    loaded = FrequencyStats.load(path, tables=TABLES)
    assert loaded.is_float and loaded.decay == 0.9
    for name in ("small", "medium"):
        assert torch.equal(loaded.counts(name), stats.counts(name))
    for name in stats.table_names:
        assert loaded.lookups(name) == stats.lookups(name)
    assert (loaded.num_batches, loaded.num_samples) == (stats.num_batches, stats.num_samples)
    assert torch.equal(loaded.sketch("large").table, stats.sketch("large").table)
    for x, y in zip(loaded.top_counts("large"), stats.top_counts("large")):
        assert torch.equal(x, y)
    # both keep counting (and decaying, by their decay option) alike
    for kjt in stream(8, batches=3):
        loaded.update(kjt)
        stats.update(kjt)
    assert torch.equal(loaded.counts("medium"), stats.counts("medium"))
    assert torch.equal(loaded.sketch("large").table, stats.sketch("large").table)
    for x, y in zip(loaded.top_counts("large"), stats.top_counts("large")):
        assert torch.equal(x, y)


def test_version_1_files_still_load(tmp_path):
    stats = FrequencyStats(TABLES, **KW)
    for kjt in stream(9, batches=2):
        stats.update(kjt)
    state = stats.state_dict()
    for key in ("count_dtype", "decay", "merged"):
        del state[key]
    state["format_version"] = 1
    state["checksum"] = state_checksum(state)
    torch.save(state, tmp_path / "v1.pt")
    loaded = FrequencyStats.load(tmp_path / "v1.pt")
    assert not loaded.is_float and torch.equal(loaded.counts("medium"), stats.counts("medium"))


@pytest.mark.parametrize("how, says", [
    ("count dtype", "count_dtype is 'float16'"),
    ("int counts in a float file", "counts of table 'small' is a torch.int64 tensor .* expected 1-D float64"),
    ("nan count", "counts of table 'medium' holds a non-finite count"),
    ("negative float count", "counts of table 'medium' holds a negative count"),
    ("sketch dtype", "sketch of table 'large': table is a torch.int64 tensor"),
    ("counts vs lookups", "counts of table 'small' add up to"),
    ("decay", "decay is 2.0"),
    ("merged", "merged is 'yes'"),
    ("v2 key missing", r"missing key\(s\) \['decay'\]"),
])
def test_decayed_state_schema_names_the_field(tmp_path, how, says):
    state = _decayed().state_dict()
    if how == "count dtype":
        state["count_dtype"] = "float16"
    elif how == "int counts in a float file":
        state["counts"]["small"] = state["counts"]["small"].round().long()
    elif how == "nan count":
        state["counts"]["medium"][3] = float("nan")
    elif how == "negative float count":
        state["counts"]["medium"][3] = -0.5
    elif how == "sketch dtype":
        state["sketches"]["large"]["table"] = state["sketches"]["large"]["table"].long()
    elif how == "counts vs lookups":
        state["lookups"]["small"] *= 1.001
    elif how == "decay":
        state["decay"] = 2.0
    elif how == "merged":
        state["merged"] = "yes"
    elif how == "v2 key missing":
        del state["decay"]
    state["checksum"] = state_checksum(state)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=says):
        FrequencyStats.load(tmp_path / "bad.pt")
