"""The OS-level byte counter the benchmarks report, checked against a collective of known size.

An all_to_all_single of 1 MB to each peer on W gloo ranks must read (W-1) MB sent per rank,
within 1% (gloo's framing and the kernel's accounting add a few hundred bytes).
"""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from torchrec_hybrid.comm_bytes import count_sent_bytes

MB = 1 << 20


def _all_to_all_bytes(rank: int, world: int) -> int:
    per_peer = MB // 4  # float32 elements
    send = torch.full((world * per_peer,), float(rank))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # warm-up: connections and buffers
    dist.barrier()
    with count_sent_bytes() as n:
        dist.all_to_all_single(recv, send)
    dist.barrier()
    assert torch.equal(recv.view(world, per_peer)[:, 0], torch.arange(world, dtype=torch.float32))
    return n[0]


@pytest.mark.parametrize("world", [2, 3])
def test_counted_bytes_match_all_to_all(world):
    sent = run_ranks(_all_to_all_bytes, world, timeout=120)
    for rank, n in enumerate(sent):
        assert abs(n - (world - 1) * MB) <= 0.01 * (world - 1) * MB, (rank, n)
