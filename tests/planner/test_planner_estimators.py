"""Hybrid perf/storage estimates against the formulas recomputed here."""

import math

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner.constants import DDR_MEM_BW

from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.planner import HybridEnumerator, gloo_topology
from tests.planner.planner_testutils import exact_stats, tables, zipf_probs
import torchrec


def test_hybrid_perf_and_storage_terms():
    W, B, D, N = 4, 256, 16, 20_000
    cfg = tables({"t": N}, dim=D)
    st = exact_stats(cfg, {"t": zipf_probs(N, 1.2)})
    topo = gloo_topology(W, bandwidth_gbps=2.0)
    enum = HybridEnumerator(topo, B, frequency_stats=st)
    sharder = HybridEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    opts = enum.enumerate(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")), [sharder])
    hyb = [o for o in opts if o.sharding_type == FREQUENCY_HYBRID]
    assert len(hyb) == 1 and len(hyb[0].shards) == W
    so, ch = hyb[0], hyb[0].hybrid_choice
    H, c = ch.hot_rows, 1.0 - ch.coverage
    bw = 2.0 * 1024 ** 3 / 1000
    scale = W / (W - 1)
    lengths = (W - 1) * (B * c / W * 4 + 8)  # non-empty bags only, + one batch size
    cold_ids = c * (W - 1) / W * B * 4
    partials = 2 * D * 4 * B * c * (W - 1) / W
    sync = 2 * (W - 1) / W * H * D * 4  # hot rows out, their gradients back: half each way
    perf = so.shards[0].perf
    assert math.isclose(perf.input_dist_comms, scale * (lengths + cold_ids) / bw, rel_tol=1e-9)
    assert math.isclose(perf.fwd_comms, scale * (partials + sync) / 2 / bw, rel_tol=1e-9)
    assert math.isclose(perf.bwd_comms, scale * (partials + sync) / 2 / bw, rel_tol=1e-9)
    fwd = (B * 8 + B * D * 4 + B * D * 4 * (1 + c)) / DDR_MEM_BW
    assert math.isclose(perf.fwd_compute, fwd, rel_tol=1e-9)
    assert math.isclose(perf.bwd_compute, 2 * fwd + 3 * max(H, 1) * (D + 1) * 4 / DDR_MEM_BW, rel_tol=1e-9)
    per_row = D * 4 + 4  # rowwise adagrad: one fp32 per row
    io = B * 8 + (W + 1) * B * D * 4
    for shard in so.shards:
        assert shard.storage.hbm == 0
        assert shard.storage.ddr == shard.size[0] * per_row + max(H, 1) * D * 4 + io  # replica: no state
    # stock options kept their stock estimates
    assert all(o.shards[0].perf is not None for o in opts)
