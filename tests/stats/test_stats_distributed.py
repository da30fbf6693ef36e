"""all_reduce_ over 2 gloo ranks: identical statistics, equal to counting the union (also
decayed statistics merged on a schedule, and after a resume from merged statistics)."""

import os

import pytest
import torch
from stats_testutils import one_feature_kjts, table, zipf_stream
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.spawn import spawn_ranks
from torchrec_hybrid.stats import FrequencyStats
from torchrec_hybrid.stats.persistence import state_checksum

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


# -- decayed statistics merged on a schedule (issue 19) ------------------------------------
STEPS, MORE, FACTOR, MERGE_AFTER = 8, 3, 0.8, {2, 5, 7}


def step_batch(rank, step):
    """Rank r's batch of a step: both tables, Zipf ids, a different stream per rank and step."""
    e = zipf_stream(5000, 2000, 1.1, seed=1000 * rank + step)
    s = zipf_stream(100_000, 3000, 1.2, seed=1000 * rank + step + 500)
    return KeyedJaggedTensor(keys=["f_e", "f_s"], values=torch.cat([e, s]),
                             lengths=torch.tensor([1] * 2000 + [1] * 1000 + [2] * 1000, dtype=torch.int32),
                             stride=2000)


class CountCollectives:
    """Counts torch.distributed collectives issued inside the block."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        import torch.distributed as dist
        self.saved = {f: getattr(dist, f) for f in ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast")}

        def wrap(fn):
            def counted(*a, **kw):
                self.n += 1
                return fn(*a, **kw)
            return counted
        for f, fn in self.saved.items():
            setattr(dist, f, wrap(fn))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for f, fn in self.saved.items():
            setattr(dist, f, fn)


def _decay_worker(rank, world, emit, out_dir):
    torch.set_num_threads(1)
    stats, collectives = make_stats(), []
    for step in range(STEPS):
        stats.decay_(FACTOR)
        stats.update(step_batch(rank, step))
        if step in MERGE_AFTER:
            with CountCollectives() as c:
                stats.all_reduce_(check=step != 5)
            collectives.append(c.n)
    assert stats.is_merged
    before = stats.state_dict()
    stats.all_reduce_()  # nothing new: merging again changes nothing
    assert state_checksum(stats.state_dict()) == state_checksum(before)
    stats.save(os.path.join(out_dir, f"decayed{rank}.pt"))
    # resume from the merged file: later merges add only what is counted after the load
    resumed = FrequencyStats.load(os.path.join(out_dir, f"decayed{rank}.pt"))
    for step in range(STEPS, STEPS + MORE):
        resumed.decay_(FACTOR)
        resumed.update(step_batch(rank, step))
    resumed.all_reduce_()
    resumed.save(os.path.join(out_dir, f"resumed{rank}.pt"))
    exact_only = FrequencyStats([table("exact", 5000, ["f_e"])], decay=0.9)
    exact_only.update(step_batch(rank, 0))
    with CountCollectives() as c:
        exact_only.all_reduce_(check=False)
    collectives.append(c.n)
    emit(collectives)


def _reference(steps):
    ref = make_stats()
    for step in range(steps):
        ref.decay_(FACTOR)
        for r in range(WORLD):
            ref.update(step_batch(r, step))
    return ref


def _check_equal_to_reference(path_of, ref):
    ranks = [FrequencyStats.load(path_of(r)) for r in range(WORLD)]
    for s in ranks:
        assert state_checksum(s.state_dict()) == state_checksum(ranks[0].state_dict())  # bit for bit
    got = ranks[0]
    assert got.is_float and got.num_batches == ref.num_batches
    assert got.num_samples == pytest.approx(ref.num_samples, rel=1e-12)
    torch.testing.assert_close(got.counts("exact"), ref.counts("exact"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.sketch("sketched").table, ref.sketch("sketched").table, rtol=1e-12, atol=1e-12)
    for name in ref.table_names:
        assert got.lookups(name) == pytest.approx(ref.lookups(name), rel=1e-12)
    ids, est = got.top_counts("sketched", 20)
    rids, rest = ref.top_counts("sketched", 20)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(est, rest, rtol=1e-12, atol=1e-12)


def test_decayed_statistics_merged_on_a_schedule_equal_one_process(tmp_path):
    out = spawn_ranks(_decay_worker, WORLD, timeout=120, out_dir=str(tmp_path))
    # per merge: one all-reduce + one all-gather (sketch candidates), + one tiny check;
    # exact tables only, unchecked: a single collective
    assert out == [[[3, 2, 3, 1]]] * WORLD
    _check_equal_to_reference(lambda r: tmp_path / f"decayed{r}.pt", _reference(STEPS))
    _check_equal_to_reference(lambda r: tmp_path / f"resumed{r}.pt", _reference(STEPS + MORE))
