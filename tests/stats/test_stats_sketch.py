"""CountMinTopK: error bound, heavy-hitter recall on Zipf data, memory bound, merging."""

import math
import time

import numpy as np
import torch
from stats_testutils import zipf_stream

from torchrec_hybrid.stats import CountMinTopK
from torchrec_hybrid.stats.sketch import sketch_shape


def test_shape_follows_eps_delta():
    depth, width = sketch_shape(1e-3, 0.01)
    assert width >= math.e / 1e-3 and width & (width - 1) == 0 and width < 2 * math.e / 1e-3
    assert depth == math.ceil(math.log(100))


def test_never_underestimates_and_error_bound_holds():
    ids = zipf_stream(50_000, 200_000, 1.05, seed=3)
    eps, delta = 1e-3, 0.05
    sk = CountMinTopK(50_000, capacity=100, eps=eps, delta=delta)
    for part in ids.split(7_000):
        sk.update(part)
    true = torch.bincount(ids, minlength=50_000)
    est = sk.estimate(torch.arange(50_000))
    assert (est >= true).all()
    over = (est - true) > eps * ids.numel()
    assert over.float().mean() <= delta  # bound holds with probability >= 1 - delta


def test_recovers_top_percent_of_zipf_stream_within_memory_bound():
    """Zipf(1.1) stream of 10M lookups over 10M rows: recall of the top 1% of distinct ids."""
    n, length = 10_000_000, 10_000_000
    ids = zipf_stream(n, length, 1.1, seed=0)
    true = torch.bincount(ids, minlength=n)
    k = int((true > 0).sum()) // 100
    true_top = torch.sort(true, descending=True, stable=True).indices[:k]
    sk = CountMinTopK(n, capacity=2 * k, eps=1e-5, delta=0.05)
    bound = sk.memory_bound_bytes()
    assert bound < 8 * n / 4  # the point: far less than exact int64 counts
    start = time.perf_counter()
    for part in ids.split(1 << 16):
        sk.update(part)
        assert sk.memory_bytes() <= bound
    elapsed = time.perf_counter() - start
    found, est = sk.top(k)
    recall = np.isin(found.numpy(), true_top.numpy()).mean()
    print(f"recall {recall:.4f} of top {k}; memory {sk.memory_bytes()} B (bound {bound}); "
          f"{length / elapsed / 1e6:.1f}M ids/s")
    assert recall >= 0.95
    assert (est >= true[found]).all()


def test_merge_equals_sketch_of_union():
    a_ids = zipf_stream(200_000, 300_000, 1.2, seed=5)
    b_ids = zipf_stream(200_000, 300_000, 1.2, seed=6)
    a, b, union = (CountMinTopK(200_000, 1000, eps=1e-4, delta=0.05) for _ in range(3))
    for part in a_ids.split(20_000):
        a.update(part)
        union.update(part)
    for part in b_ids.split(20_000):
        b.update(part)
        union.update(part)
    a.merge_(b)
    assert torch.equal(a.table, union.table)  # the sketch is linear
    ids, est = a.top(100)
    uids, uest = union.top(100)
    assert torch.equal(ids, uids) and torch.equal(est, uest)
    true = torch.bincount(torch.cat([a_ids, b_ids]), minlength=200_000)
    assert set(ids[:50].tolist()) == set(torch.sort(true, descending=True, stable=True).indices[:50].tolist())


def test_state_dict_round_trip():
    sk = CountMinTopK(1000, 10, eps=1e-2, delta=0.1, seed=7)
    sk.update(zipf_stream(1000, 5000, 1.3, seed=1))
    back = CountMinTopK.from_state_dict(sk.state_dict())
    for x, y in zip(back.top(), sk.top()):
        assert torch.equal(x, y)
    probe = torch.arange(1000)
    assert torch.equal(back.estimate(probe), sk.estimate(probe))
