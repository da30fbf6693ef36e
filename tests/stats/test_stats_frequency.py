"""FrequencyStats: exact counting, validation, merging, persistence."""

import numpy as np
import pytest
import torch
from stats_testutils import feature_values, one_feature_kjts, random_kjt, table, zipf_stream

from torchrec_hybrid.stats import FORMAT_VERSION, FrequencyStats

TABLES = [table("small", 50, ["f_a", "f_b"]),  # two features share a table
          table("medium", 3000, ["f_c"]),
          table("large", 20_000, ["f_d"])]
ROWS = {"f_a": 50, "f_b": 50, "f_c": 3000, "f_d": 20_000, "f_unknown": 10**9}
FEATURE_TABLE = {"f_a": "small", "f_b": "small", "f_c": "medium", "f_d": "large"}


def stream(seed, batches=6, weighted=False):
    rng = np.random.default_rng(seed)
    return [random_kjt(rng, ROWS, batch=int(rng.integers(1, 300)), weighted=weighted)
            for _ in range(batches)]


def numpy_counts(kjts):
    out = {t.name: np.zeros(t.num_embeddings, dtype=np.int64) for t in TABLES}
    for kjt in kjts:
        for f, v in feature_values(kjt).items():
            if f in FEATURE_TABLE:
                out[FEATURE_TABLE[f]] += np.bincount(v, minlength=out[FEATURE_TABLE[f]].size)
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_exact_counts_match_numpy(weighted):
    kjts = stream(0, weighted=weighted)
    stats = FrequencyStats(TABLES)
    for kjt in kjts:
        stats.update(kjt)
    expected = numpy_counts(kjts)
    for name, exp in expected.items():
        assert stats.is_exact(name)
        np.testing.assert_array_equal(stats.counts(name).numpy(), exp)
        assert stats.lookups(name) == exp.sum()
        assert stats.memory_bytes()[name] == 8 * exp.size
    assert stats.num_batches == len(kjts)
    assert stats.num_samples == sum(k.stride() for k in kjts)


def test_top_counts_order_and_ties():
    stats = FrequencyStats([table("t", 6, ["f"])])
    ids = torch.tensor([4, 4, 1, 1, 5, 2, 2, 2])  # counts: 1->2, 2->3, 4->2, 5->1
    stats.update(one_feature_kjts(ids, "f", 8)[0])
    top_ids, top_c = stats.top_counts("t")
    c = np.bincount(ids.numpy(), minlength=6)
    expected = sorted((i for i in range(6) if c[i] > 0), key=lambda i: (-c[i], i))
    assert top_ids.tolist() == expected
    assert top_c.tolist() == [c[i] for i in expected]


@pytest.mark.parametrize("bad", [-1, 50, 77])
def test_out_of_range_ids_raise(bad):
    stats = FrequencyStats(TABLES)
    kjt = one_feature_kjts(torch.tensor([0, 3, bad, 1]), "f_b", 4)[0]
    with pytest.raises(ValueError, match=rf"f_b.*small.*{bad}"):
        stats.update(kjt)
    assert stats.lookups("small") == 0  # nothing counted from a rejected batch


def test_sketched_table_counts_heavy_ids():
    ids = zipf_stream(100_000, 200_000, 1.2, seed=1)
    stats = FrequencyStats([table("big", 100_000, ["f"])], exact_max_rows=1000,
                           sketch_capacity=500, sketch_eps=1e-4)
    for kjt in one_feature_kjts(ids, "f", 10_000):
        stats.update(kjt)
    assert not stats.is_exact("big")
    true = torch.bincount(ids, minlength=100_000)
    top_ids, est = stats.top_counts("big", 50)
    assert (est >= true[top_ids]).all()  # Count-Min never underestimates
    assert set(top_ids.tolist()) == set(torch.sort(true, descending=True, stable=True).indices[:50].tolist())
    assert stats.lookups("big") == ids.numel()
    assert stats.memory_bytes()["big"] <= stats.sketch("big").memory_bound_bytes()


def _mixed_stats():
    return FrequencyStats(TABLES, exact_max_rows=5000, sketch_capacity=300, sketch_eps=1e-2)


def test_merge_equals_counting_the_union():
    a_kjts, b_kjts = stream(1), stream(2)
    a, b, union = _mixed_stats(), _mixed_stats(), _mixed_stats()
    for k in a_kjts:
        a.update(k)
        union.update(k)
    for k in b_kjts:
        b.update(k)
        union.update(k)
    a_before = a.counts("small").clone()
    m = FrequencyStats.merged(a, b)
    assert torch.equal(a.counts("small"), a_before)  # merged() leaves its inputs alone
    a.merge_(b)
    for s in (m, a):
        for name in ("small", "medium"):
            assert torch.equal(s.counts(name), union.counts(name))
        assert torch.equal(s.sketch("large").table, union.sketch("large").table)
        assert s.lookups("large") == union.lookups("large")
        assert (s.num_batches, s.num_samples) == (union.num_batches, union.num_samples)
        # candidates are re-estimated from the merged table (heavy-hitter agreement on a
        # skewed stream is tested in test_stats_sketch.py)
        ids, est = s.top_counts("large")
        assert torch.equal(est, union.sketch("large").estimate(ids))


def test_merge_refuses_other_tables():
    other = FrequencyStats([table("small", 51, ["f_a"])])
    with pytest.raises(ValueError, match="small"):
        FrequencyStats(TABLES).merge_(other)


def test_save_load_round_trip(tmp_path):
    stats = _mixed_stats()
    for k in stream(3):
        stats.update(k)
    path = tmp_path / "stats.pt"
    stats.save(path)
    raw = torch.load(path, weights_only=True)
    assert raw["format_version"] == FORMAT_VERSION and [t["name"] for t in raw["tables"]] == stats.table_names
    for loaded in (FrequencyStats.load(path), FrequencyStats.load(path, tables=TABLES)):
        for name in ("small", "medium"):
            assert torch.equal(loaded.counts(name), stats.counts(name))
        for name in stats.table_names:
            assert loaded.lookups(name) == stats.lookups(name)
            assert loaded.config(name).feature_names == stats.config(name).feature_names
        for x, y in zip(loaded.top_counts("large"), stats.top_counts("large")):
            assert torch.equal(x, y)
        assert torch.equal(loaded.sketch("large").table, stats.sketch("large").table)
        assert (loaded.num_batches, loaded.num_samples) == (stats.num_batches, stats.num_samples)
    # a loaded sketch keeps counting like the original
    more = stream(4)
    loaded = FrequencyStats.load(path)
    for k in more:
        loaded.update(k)
        stats.update(k)
    assert torch.equal(loaded.sketch("large").table, stats.sketch("large").table)
    assert torch.equal(loaded.counts("medium"), stats.counts("medium"))


@pytest.mark.parametrize("tables, name", [
    ([table("small", 50, ["f_a", "f_b"]), table("medium", 3001, ["f_c"]), table("large", 20_000, ["f_d"])], "medium"),
    ([table("small", 50, ["f_a", "f_b"]), table("medium", 3000, ["f_c"]), table("huge", 20_000, ["f_d"])], "large"),
    ([table("small", 50, ["f_a", "f_b"]), table("medium", 3000, ["f_c"])], "large"),
])
def test_mismatched_file_is_refused(tmp_path, tables, name):
    stats = FrequencyStats(TABLES)
    stats.update(stream(5, batches=1)[0])
    stats.save(tmp_path / "s.pt")
    with pytest.raises(ValueError, match=repr(name)):
        FrequencyStats.load(tmp_path / "s.pt", tables=tables)
    with pytest.raises(ValueError, match=repr(name)):
        stats.check_compatible(tables)
    stats.check_compatible(TABLES)  # the right tables pass


def test_unknown_format_version_is_refused(tmp_path):
    state = FrequencyStats(TABLES).state_dict()
    state["format_version"] = 99
    torch.save(state, tmp_path / "s.pt")
    with pytest.raises(ValueError, match="format_version"):
        FrequencyStats.load(tmp_path / "s.pt")


def test_statistics_of_the_same_tables_in_another_order_are_refused():
    """Counters are laid out table after table: merging statistics that list the same tables in
    another order used to add one table's counts into another's; all_reduce_'s layout check now
    tells the two orders apart too."""
    a, b = FrequencyStats(TABLES), FrequencyStats(TABLES[::-1])
    b.update(random_kjt(np.random.default_rng(0), ROWS, batch=8))
    with pytest.raises(ValueError, match="another order"):
        a.merge_(b)
    with pytest.raises(ValueError, match="another order"):
        FrequencyStats.merged(a, b)
    assert a._signature() != b._signature()


@pytest.mark.parametrize("bad", [-1, 50])
def test_hot_share_refuses_ids_outside_the_table(bad):
    stats = FrequencyStats(TABLES)
    stats.update(random_kjt(np.random.default_rng(0), ROWS, batch=8))
    with pytest.raises(ValueError, match=f"table 'small': hot id {bad} is outside \\[0, 50\\)"):
        stats.hot_share({"small": torch.tensor([3, bad])})


def test_statistics_of_no_table_are_refused():
    with pytest.raises(ValueError, match="no tables to count"):
        FrequencyStats([])
