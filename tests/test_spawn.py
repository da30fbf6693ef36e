"""spawn_ranks: results per rank, a failing rank's traceback, a hanging rank's deadline."""

import time

import pytest
import torch
import torch.distributed as dist

from torchrec_hybrid.spawn import RankFailure, spawn_ranks


def _sum_of_ranks(rank, world, emit, repeats):
    for i in range(repeats):
        t = torch.tensor([rank + i])
        dist.all_reduce(t)
        emit((rank, int(t)))


def _one_rank_raises(rank, world, emit):
    if rank == 1:
        raise ValueError("rank one is broken")
    emit(rank)


def _one_rank_hangs(rank, world, emit):
    if rank == 0:
        time.sleep(600)
    emit(rank)


def test_each_rank_emits_in_order():
    out = spawn_ranks(_sum_of_ranks, 3, expected=2, timeout=120, repeats=2)
    assert out == [[(r, 3), (r, 6)] for r in range(3)]  # 0+1+2, then 1+2+3


def test_a_failing_rank_fails_the_run_with_its_traceback():
    with pytest.raises(RankFailure, match="(?s)rank 1 failed.*ValueError: rank one is broken"):
        spawn_ranks(_one_rank_raises, 2, timeout=120)


def test_a_hanging_rank_fails_the_run_at_the_deadline():
    start = time.time()
    with pytest.raises(RankFailure, match=r"ranks \[0\] hung or died"):
        spawn_ranks(_one_rank_hangs, 2, timeout=15)
    assert time.time() - start < 60
