"""Every option, stock or hybrid, priced by the one byte model; hybrid storage terms."""

import math

import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.planner import HybridEnumerator, gloo_topology
from torchrec_hybrid.planner import cost_model as cm
from tests.planner.planner_testutils import exact_stats, tables, zipf_probs

W, B, D, N = 4, 256, 16, 20_000


def _options():
    cfg = tables({"t": N}, dim=D)
    st = exact_stats(cfg, {"t": zipf_probs(N, 1.2)})
    enum = HybridEnumerator(gloo_topology(W, bandwidth_gbps=2.0), B, frequency_stats=st)
    sharder = HybridEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    return enum.enumerate(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")), [sharder])


def test_every_option_is_priced_by_the_byte_model():
    opts = _options()
    bw = 2.0 * 1024 ** 3 / 1000
    t = cm.TableTraffic(rows=N, dim=D, features=1, pooling=1.0, batch=B, world=W)
    tw = [o for o in opts if o.sharding_type == "table_wise"][0]
    # a table_wise table: what its owner sends plus what every other rank sends it
    assert math.isclose(tw.total_perf * bw, W * cm.model("table_wise").mean_bytes(t), rel_tol=1e-9)
    hyb = {o.hybrid_choice.cold_layout: o for o in opts if o.sharding_type == FREQUENCY_HYBRID}
    assert set(hyb) == {"row_wise", "table_wise"}
    assert len(hyb["row_wise"].shards) == W and len(hyb["table_wise"].shards) == 1
    for so in hyb.values():  # the shards' costs add up to the bytes every rank sends for the table
        assert math.isclose(so.total_perf * bw, float(cm.HYBRID.rank_cost(so, t, owner=0)[0].sum()), rel_tol=1e-6)
        assert so.total_perf < tw.total_perf  # skewed ids: hybrid is cheaper under the same model


def test_per_rank_model_averages_to_the_mean_model():
    t = cm.TableTraffic(rows=N, dim=D, features=2, pooling=3.0, batch=B, world=W)
    cov, h = 0.7, 100
    even = torch.full((W,), 1.0 / W, dtype=torch.float64)
    per_rank = cm.HYBRID.rank_bytes(t, cov, even, even * h)
    mean = sum(float(v) for v in cm.HYBRID.parts(t, cov, h).values()) - (W - 1) * t.features * 2 * 4
    assert math.isclose(float(per_rank.mean()), mean, rel_tol=1e-9)
    assert torch.allclose(per_rank, per_rank[0].expand(W))  # even layout: every rank alike
    tw = cm.model("table_wise").rank_bytes(t, owner=2)
    assert math.isclose(float(tw.mean()), cm.model("table_wise").mean_bytes(t), rel_tol=1e-9)
    assert int(tw.argmax()) == 2  # the owner sends the pooled vectors to everyone


def test_hybrid_storage_terms():
    so = [o for o in _options() if o.sharding_type == FREQUENCY_HYBRID][0]
    H = so.hybrid_choice.hot_rows
    per_row = D * 4 + 4  # rowwise adagrad: one fp32 per row
    io = B * 8 + (W + 1) * B * D * 4
    for shard in so.shards:
        assert shard.storage.hbm == 0
        assert shard.storage.ddr == shard.size[0] * per_row + max(H, 1) * D * 4 + io  # replica: no state


def test_stock_column_shards_are_each_priced_as_a_table_wise_exchange():
    """Each column shard of a stock column_wise option costs its own table-wise exchange, whatever
    its index: a table cut in more column shards than there are ranks used to crash the CPU-priced
    planner (a rank's cost looked up by shard index) and its second shard was priced at a non-owner's
    share (a fifth of the first)."""
    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner
    from torchrec_hybrid.planner.compute_costs import CPU_GLOO
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.planner.stats import NoopEmbeddingStats

    ebc = torchrec.EmbeddingBagCollection(tables=tables({"t": 1000}, dim=256), device=torch.device("meta"))
    options = HybridEnumerator(gloo_topology(4), 64, compute_costs=CPU_GLOO).enumerate(
        ebc, [HybridEmbeddingBagCollectionSharder()])
    by_type = {so.sharding_type: so for so in options}
    shards = by_type["column_wise"].shards
    assert len(shards) > 1
    assert all(math.isclose(s.perf.fwd_compute, shards[0].perf.fwd_compute) for s in shards)
    # two half-width exchanges cost more compute than one full-width one, not less
    assert sum(s.perf.fwd_compute for s in shards) > by_type["table_wise"].shards[0].perf.fwd_compute
    # more column shards than ranks: planned, every shard placed
    wide = torchrec.EmbeddingBagCollection(tables=tables({"t": 1000}, dim=512), device=torch.device("meta"))
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(2), batch_size=64, stats=[NoopEmbeddingStats()],
                                             constraints={"t": ParameterConstraints(sharding_types=["column_wise"])})
    spec = planner.plan(wide, [HybridEmbeddingBagCollectionSharder()]).plan[""]["t"].sharding_spec
    assert len(spec.shards) > 2
