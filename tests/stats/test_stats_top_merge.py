"""merged_top_ids over 3 gloo ranks: the same hot sets on every rank; with every counted row a candidate
they are exactly the dense merge's (all_reduce_) top ids, with 2x oversampling nearly so, for a small
fraction of the dense merge's bytes."""

import pytest
import torch
from stats_testutils import one_feature_kjts, table

from torchrec_hybrid.spawn import spawn_ranks
from torchrec_hybrid.stats import FrequencyStats
from torchrec_hybrid.stats.top_merge import candidate_counts, merged_top_ids

WORLD = 3
TABLES = [table("a", 5000, ["f_a"]), table("b", 3000, ["f_b"]), table("c", 100, ["f_c"])]
SIZES = {"a": 200, "b": 50, "c": 0}


def _ids(rows: int, n: int, alpha: float, rank: int) -> torch.Tensor:
    """``n`` Zipf(alpha) ids: the same popularity order on every rank (seed 0), samples of the rank's own."""
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    p = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    return order[torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(10 + rank))]


def _stats(rank):
    stats = FrequencyStats(TABLES, decay=0.9)
    kjts = one_feature_kjts(_ids(5000, 20_000, 1.1, rank), "f_a", 2000) + \
        one_feature_kjts(_ids(3000, 20_000, 1.05, rank), "f_b", 2000)
    for kjt in kjts:
        stats.update(kjt)
    return stats


def _worker(rank, world, emit):
    torch.set_num_threads(1)
    stats = _stats(rank)
    every_row, _ = merged_top_ids(stats, SIZES, oversample=5000.0)
    twice, sent = merged_top_ids(stats, SIZES, oversample=2.0)
    stats.all_reduce_()
    dense = {t: torch.sort(stats.top_counts(t, n)[0]).values for t, n in SIZES.items() if n}
    lists = lambda d: {t: v.tolist() for t, v in d.items()}  # noqa: E731 - plain data through the queue
    emit({"every_row": lists(every_row), "twice": lists(twice), "dense": lists(dense), "sent": sent})


def test_merged_top_ids_match_the_dense_merge():
    out = [{k: {t: torch.tensor(v, dtype=torch.int64) for t, v in d.items()} if isinstance(d, dict) else d
            for k, d in r[0].items()} for r in spawn_ranks(_worker, WORLD, timeout=120)]
    for r in out:  # the same on every rank
        for key in ("every_row", "twice"):
            assert all(torch.equal(r[key][t], out[0][key][t]) for t in SIZES), key
    o = out[0]
    assert o["every_row"]["c"].numel() == 0 and o["twice"]["c"].numel() == 0
    for t, n in SIZES.items():
        if not n:
            continue
        assert torch.equal(o["every_row"][t], o["dense"][t]), t  # all candidates: the dense merge's ranking
        assert o["twice"][t].numel() == n
        same = torch.isin(o["twice"][t], o["dense"][t]).float().mean()
        assert same >= 0.95, (t, float(same))
    assert o["sent"] == 8 * sum(candidate_counts(SIZES, {"a": 5000, "b": 3000, "c": 100}, 2.0, 64).values())


def test_merged_top_ids_refuse_what_they_cannot_do():
    stats = FrequencyStats(TABLES)
    with pytest.raises(ValueError, match="oversample must be >= 1, got 0.5"):
        merged_top_ids(stats, SIZES, oversample=0.5)
    with pytest.raises(ValueError, match=r"tables \['zz'\] are not counted"):
        merged_top_ids(stats, {"zz": 3})
