"""all_reduce_ over 2 gloo ranks: identical statistics, equal to counting the union."""

import os

import torch
from stats_testutils import one_feature_kjts, table, zipf_stream

from torchrec_hybrid.spawn import spawn_ranks
from torchrec_hybrid.stats import FrequencyStats

WORLD = 2
TABLES = [table("exact", 5000, ["f_e"]), table("sketched", 100_000, ["f_s"])]


def make_stats():
    return FrequencyStats(TABLES, exact_max_rows=10_000, sketch_capacity=200, sketch_eps=1e-3)


def rank_batches(rank):
    """Rank r's share of the data: a different Zipf stream per rank and table."""
    e = zipf_stream(5000, 30_000, 1.1, seed=10 + rank)
    s = zipf_stream(100_000, 60_000, 1.2, seed=20 + rank)
    return one_feature_kjts(e, "f_e", 4096) + one_feature_kjts(s, "f_s", 8192)


def _worker(rank, world, emit, out_dir):
    torch.set_num_threads(1)
    stats = make_stats()
    for kjt in rank_batches(rank):
        stats.update(kjt)
    stats.all_reduce_()
    stats.save(os.path.join(out_dir, f"rank{rank}.pt"))
    emit(rank)


def test_all_reduce_matches_union(tmp_path):
    assert spawn_ranks(_worker, WORLD, timeout=120, out_dir=str(tmp_path)) == [[r] for r in range(WORLD)]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    union = make_stats()
    for r in range(WORLD):
        for kjt in rank_batches(r):
            union.update(kjt)
    expected = union.state_dict()
    for state in ranks:
        assert torch.equal(state["counts"]["exact"], ranks[0]["counts"]["exact"])
        assert torch.equal(state["counts"]["exact"], expected["counts"]["exact"])
        for key in ("table", "cand_ids", "cand_est"):  # identical on every rank
            assert torch.equal(state["sketches"]["sketched"][key], ranks[0]["sketches"]["sketched"][key])
        assert torch.equal(state["sketches"]["sketched"]["table"], expected["sketches"]["sketched"]["table"])
        assert state["lookups"] == expected["lookups"]
        assert (state["num_batches"], state["num_samples"]) == (expected["num_batches"], expected["num_samples"])
    # heavy hitters of the reduced sketch are those of the union
    reduced = FrequencyStats.from_state(ranks[0])
    ids, est = reduced.top_counts("sketched", 20)
    uids, uest = union.top_counts("sketched", 20)
    assert torch.equal(ids, uids) and torch.equal(est, uest)
