"""SyntheticCriteo drift: popularity moves over batches, deterministically; no drift gives the
batches of before (issue 19)."""

import zlib

import pytest
import torch

from torchrec_hybrid.stats import FrequencyStats, HotSetCoverage, SyntheticCriteo, criteo_tables, select_hot_ids

SIZES = [50, 1000, 3, 100_000]


def crc(gen):
    c = 0
    for kjt in gen:
        c = zlib.crc32(kjt.values().numpy().tobytes(), c)
        c = zlib.crc32(kjt.lengths().numpy().tobytes(), c)
    return c


@pytest.mark.parametrize("kw, golden", [
    (dict(multi_hot=[1, 3, 2, 1]), 3773171101),
    (dict(sorted_ids=True), 350411717),
])
def test_no_drift_reproduces_the_batches_of_before(kw, golden):
    # golden: CRC32 of these batches from the generator before drift existed (commit 1b53660)
    args = dict(table_sizes=SIZES, batch_size=64, num_batches=4, alpha=1.1, seed=7) | kw
    assert crc(SyntheticCriteo(**args)) == golden
    assert crc(SyntheticCriteo(**args, drift=0.0, drift_rows=0.0)) == golden


@pytest.mark.parametrize("mode", ["rise", "burst"])
def test_top_ids_rotate_at_the_given_rate(mode):
    data = SyntheticCriteo([100_000], batch_size=1, num_batches=1, drift_rows=1.0, drift_mode=mode, seed=3)
    k, n = 2000, 100_000
    ranking0 = data.top_ids(0, n)["cat_0"]
    start = ranking0[:k]
    for b in (1, 500, 1000, 2000):
        now = data.top_ids(b, k)["cat_0"]
        assert len(set(now.tolist()) & set(start.tolist())) == k - b  # half gone after 1,000
        if mode == "rise":  # everyone climbed b ranks: the newcomers were just below the head
            assert torch.equal(now, ranking0[b : b + k])
        else:  # the newcomers at the top were the coldest ids, the old head moved down b ranks
            assert torch.equal(now[:b], ranking0[n - b:])
            assert torch.equal(now[b:], start[: k - b])
    share = SyntheticCriteo([100_000, 5000], 1, 1, drift=1e-3, seed=3)  # 100 and 5 ranks per batch
    assert share.rank_shifts(3) == [300, 15]
    assert SyntheticCriteo([10], 1, 1, drift_rows=0.5).rank_shifts(7) == [3]  # fractional rates accumulate


def _batch_top(kjt, feature, k):
    ids = kjt.to_dict()[feature].values()
    counts = torch.bincount(ids)
    return torch.sort(counts, descending=True, stable=True).indices[:k]


def test_sampled_batches_follow_the_drift():
    data = SyntheticCriteo([5000], batch_size=8192, num_batches=30, alpha=1.2, drift=0.002, seed=1)  # 10 ranks/batch
    batches = list(data)
    assert all(torch.equal(a.values(), b.values()) for a, b in zip(batches, data))  # deterministic
    for b in (0, 7, 29):
        assert _batch_top(batches[b], "cat_0", 1).item() == data.top_ids(b, 1)["cat_0"].item()
    first, last = _batch_top(batches[0], "cat_0", 10), _batch_top(batches[29], "cat_0", 3)
    assert not set(first.tolist()) & set(_batch_top(batches[29], "cat_0", 10).tolist())
    assert set(last.tolist()) <= set(data.top_ids(29, 10)["cat_0"].tolist())
    static = next(iter(SyntheticCriteo([5000], 8192, 1, alpha=1.2, seed=1)))
    assert torch.equal(static.values(), batches[0].values())  # batch 0 is not rotated yet


def test_decayed_statistics_follow_drift_a_static_hot_set_does_not():
    """The pieces a refresh uses: under drift the batch coverage of a hot set chosen at the
    start falls, while one re-chosen from decayed statistics stays near the true top rows'."""
    sizes = [20_000, 3000]
    data = SyntheticCriteo(sizes, batch_size=2048, num_batches=40, alpha=1.1, drift_rows=20, seed=2)
    tables = criteo_tables(sizes, 8, ["cat_0", "cat_1"])
    stats = FrequencyStats(tables, decay=0.7)
    static = None
    for i, kjt in enumerate(data):
        if i == 1:
            static = HotSetCoverage(tables, select_hot_ids(stats, rows_per_table=200))
        stats.update(kjt)
    fresh = HotSetCoverage(tables, select_hot_ids(stats, rows_per_table=200))
    ideal = HotSetCoverage(tables, {f"t_{f}": ids for f, ids in data.top_ids(39, 200).items()})
    s, f, best = static.share(kjt), fresh.share(kjt), ideal.share(kjt)
    assert f > 0.8 * best and s < 0.1 * f  # measured: static 0.01, refreshed 0.61, true top 0.72


def test_bad_drift_is_refused():
    for kw, says in [({"drift": -0.1}, "drift"), ({"drift": 1.5}, "drift"), ({"drift": float("nan")}, "drift"),
                     ({"drift_rows": -1}, "drift_rows"), ({"drift": 0.1, "drift_rows": 2}, "not both"),
                     ({"drift_mode": "up"}, "drift_mode")]:
        with pytest.raises(ValueError, match=says):
            SyntheticCriteo([5, 7], 4, 1, **kw)
