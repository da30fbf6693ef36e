"""HotSetCoverage: the share of a batch's lookups a hot set serves, against a direct count."""

import numpy as np
import pytest
import torch
from stats_testutils import feature_values, random_kjt, table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.stats import FrequencyStats, HotSetCoverage

TABLES = [table("small", 50, ["f_a", "f_b"]), table("medium", 3000, ["f_c"]),
          table("large", 20_000, ["f_d"]), table("unused", 10, ["f_e"])]
ROWS = {"f_a": 50, "f_b": 50, "f_c": 3000, "f_d": 20_000, "f_unknown": 10**9}
FEATURE_TABLE = {"f_a": "small", "f_b": "small", "f_c": "medium", "f_d": "large"}


def direct(kjt, hot):
    """hits, lookups per table name by numpy set membership, feature by feature."""
    hits = {t.name: 0 for t in TABLES}
    lookups = dict(hits)
    for f, v in feature_values(kjt).items():
        if f in FEATURE_TABLE:
            name = FEATURE_TABLE[f]
            lookups[name] += v.size
            if name in hot:
                hits[name] += int(np.isin(v, hot[name].numpy()).sum())
    return hits, lookups


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coverage_matches_direct_count(seed):
    rng = np.random.default_rng(seed)
    hot = {"small": torch.from_numpy(rng.choice(50, 20, replace=False)),
           "medium": torch.from_numpy(rng.integers(0, 3000, 900)),  # duplicates allowed
           "unused": torch.tensor([1, 2])}  # "large" has no hot set
    meter = HotSetCoverage(TABLES, hot)
    assert meter.num_hot == [20, int(np.unique(hot["medium"].numpy()).size), 0, 2]
    for _ in range(4):
        kjt = random_kjt(rng, ROWS, batch=int(rng.integers(1, 300)), max_len=6)
        hits, lookups = meter.counts(kjt)
        want_hits, want_lookups = direct(kjt, hot)
        assert hits.tolist() == [want_hits[t.name] for t in TABLES]
        assert lookups.tolist() == [want_lookups[t.name] for t in TABLES]
        shares = meter(kjt)
        for t in TABLES:
            if want_lookups[t.name]:
                assert shares[t.name] == want_hits[t.name] / want_lookups[t.name]
            else:
                assert np.isnan(shares[t.name])
        assert meter.share(kjt) == sum(want_hits.values()) / sum(want_lookups.values())


def test_stats_helpers_and_empty_hot_sets():
    rng = np.random.default_rng(3)
    kjt = random_kjt(rng, ROWS, batch=64)
    stats = FrequencyStats(TABLES)
    stats.update(kjt)
    everything = {t.name: torch.arange(t.num_embeddings) for t in TABLES}
    cov = stats.batch_coverage(kjt, everything)
    assert cov["small"] == cov["medium"] == cov["large"] == 1.0 and np.isnan(cov["unused"])
    assert stats.coverage_meter({}).share(kjt) == 0.0
    # hot_share from the statistics of the same batch equals the batch's coverage
    hot = {"medium": torch.from_numpy(rng.integers(0, 3000, 500))}
    from_stats = stats.hot_share(hot)
    from_batch = stats.batch_coverage(kjt, hot)
    assert from_stats["medium"] == pytest.approx(from_batch["medium"], rel=1e-12)
    assert from_stats["small"] == 0.0 and np.isnan(from_stats["unused"])


def test_bad_ids_and_tables_are_refused():
    with pytest.raises(ValueError, match="unknown table"):
        HotSetCoverage(TABLES, {"nope": torch.tensor([1])})
    with pytest.raises(ValueError, match=r"'small' must be in \[0, 50\)"):
        HotSetCoverage(TABLES, {"small": torch.tensor([3, 50])})
    meter = HotSetCoverage(TABLES, {"small": torch.tensor([3])})
    bad = KeyedJaggedTensor(keys=["f_a", "f_c"], values=torch.tensor([3, 1, 3000]),
                            lengths=torch.tensor([1, 1, 0, 1], dtype=torch.int32), stride=2)
    with pytest.raises(ValueError, match="'medium': id 3000 is out of range"):
        meter.counts(bad)
    ok = KeyedJaggedTensor(keys=["f_a", "f_c"], values=torch.tensor([3, 1, 2999]),
                           lengths=torch.tensor([1, 1, 0, 1], dtype=torch.int32), stride=2)
    assert meter(ok)["small"] == 0.5 and meter(ok)["medium"] == 0.0


def test_ids_of_keys_that_are_no_feature_are_ignored_even_when_negative():
    """A key of no table is skipped as the docstring says; its ids are not range-checked (a -1 there
    used to crash the check looking up a table that does not exist)."""
    meter = HotSetCoverage(TABLES, {"small": torch.tensor([3])})
    kjt = KeyedJaggedTensor(keys=["f_a", "f_unknown"], values=torch.tensor([3, 4, -1]),
                            lengths=torch.tensor([2, 1], dtype=torch.int32))
    got = meter(kjt)
    assert got["small"] == 0.5
    with pytest.raises(ValueError, match="table 'small': id -1"):
        meter(KeyedJaggedTensor(keys=["f_a"], values=torch.tensor([-1]), lengths=torch.tensor([1], dtype=torch.int32)))
