"""The row-wise output term of the cost model against gloo's real collectives.

TorchRec's row-wise pooled output dist reduce-scatters [W*B, D] in forward and all-gathers
[B, D] in backward. On gloo a reduce-scatter sends as much as a ring all-reduce; the model
with ``gloo=True`` must match what the OS counts, the NCCL-shaped model must undercount it.
"""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from torchrec_hybrid.comm_bytes import count_sent_bytes
from torchrec_hybrid.planner import cost_model as cm

B, D = 2048, 64


def _row_wise_output_bytes(rank: int, world: int) -> int:
    full, part = torch.ones(world * B * D), torch.empty(B * D)
    for _ in range(2):  # the first round warms connections and buffers up
        full.fill_(1.0)
        dist.barrier()
        with count_sent_bytes() as n:
            dist.reduce_scatter_tensor(part, full)  # forward: partial sums to each sample's rank
            dist.all_gather_into_tensor(full, part)  # backward: gradients back to every owner
        dist.barrier()
    assert torch.all(part == world)
    return n[0]


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_row_wise_output_bytes_match_the_model(world):
    t = cm.TableTraffic(rows=10_000, dim=D, features=1, pooling=1.0, batch=B, world=world)
    gloo = cm.model("row_wise").parts(t, gloo=True)["output"]
    nccl = cm.model("row_wise").parts(t)["output"]
    for rank, n in enumerate(run_ranks(_row_wise_output_bytes, world, timeout=120)):
        assert abs(n - gloo) <= 0.01 * gloo, (rank, n, gloo)
        assert n > 1.2 * nccl, (rank, n, nccl)
