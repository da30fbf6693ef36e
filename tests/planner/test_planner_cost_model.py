"""The pure byte model: formulas recomputed by hand on small cases."""

import math

import torch

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.types import ROOM_PAD, ROOM_SLACK


def t4(**kw):
    base = dict(rows=1000, dim=8, features=2, pooling=1.0, batch=16, world=4)
    base.update(kw)
    return cm.TableTraffic(**base)


def test_stock_types_match_design_formulas():
    t = t4()
    W, B, F, D = 4, 16, 2, 8
    assert math.isclose(cm.model("table_wise").mean_bytes(t), 3 / 4 * (B * F * 8 + B * F * 4 + 2 * B * F * D * 4))
    assert math.isclose(cm.model("table_wise").parts(t)["output"] * W, cm.model("row_wise").parts(t)["output"])
    assert math.isclose(cm.model("data_parallel").mean_bytes(t), 2 * 3 / 4 * 1000 * D * 4)
    cw = cm.model("column_wise").mean_bytes(t, shards=2)
    assert math.isclose(cw, 3 / 4 * (2 * (B * F * 8 + B * F * 4) + 2 * B * F * D * 4))


def test_hybrid_terms_one_hot():
    t = t4()
    cov = 0.75
    p = cm.HYBRID.parts(t, cov, 10)
    W, B, F, D, c = 4, 16, 2, 8, 0.25
    s = ROOM_SLACK  # the cold payload travels in rooms that much larger (cold_all_to_all.py)
    # lengths of the bags with a cold id on each remote owner, plus two int32 counts per feature
    assert math.isclose(float(p["lengths"]), (W - 1) * (s * F * B * c / W * 4 + F * 2 * 4))
    assert math.isclose(float(p["cold_ids"]), s * c * (W - 1) / W * F * B * 4)
    assert math.isclose(float(p["partials"]), 2 * D * 4 * F * B * c * (W - 1) / W)
    # each owner's hot rows out to the other ranks, their gradients back
    assert math.isclose(float(p["hot_sync"]), 2 * (W - 1) / W * 10 * D * 4)
    assert float(cm.HYBRID.parts(t, 0.0, 0)["hot_sync"]) == 0.0


def test_multi_hot_partials_count_bags_not_ids():
    t = t4(pooling=3.0)
    c = 0.5
    p = cm.HYBRID.parts(t, 1 - c, 0)
    expect = 2 * 8 * 4 * 2 * 16 * 3 * (1 - (1 - c / 4) ** 3)
    assert math.isclose(float(p["partials"]), expect)


def test_best_hot_rows_is_brute_force_argmin():
    counts = torch.tensor([1000.0, 500, 200, 50, 10, 5, 1, 1, 1, 1])
    cov = cm.coverage_from_counts(counts)
    assert cov[0] == 0 and math.isclose(float(cov[-1]), 1.0)
    t = t4(rows=10, batch=64)
    costs = [float(cm.HYBRID.mean_bytes(t, cov[h], h)) for h in range(11)]
    assert cm.HYBRID.best_hot_rows(t, cov) == min(range(11), key=lambda h: (costs[h], h))
    assert cm.HYBRID.best_hot_rows(t, cov, max_rows=1) <= 1


def test_zero_hot_rows_moves_the_embeddings_table_wise_moves():
    """Without hot rows every pooled vector crosses the wire once each way, as in table_wise:
    only the id encoding (int32 ids, lengths of non-empty bags only) differs."""
    for w in (2, 4, 8):
        t = t4(world=w)
        p = cm.HYBRID.parts(t, 0.0, 0)
        assert math.isclose(float(p["partials"]), cm.model("table_wise").parts(t)["output"])
        assert float(p["lengths"] + p["cold_ids"]) < cm.model("table_wise").parts(t)["input"] + (w - 1) * t.features * 8


def test_memory_and_optimizer_state():
    t = t4()
    assert cm.optimizer_state_bytes_per_row("EXACT_ADAGRAD", 8) == 32
    assert cm.optimizer_state_bytes_per_row("exact_rowwise_adagrad", 8) == 4
    assert cm.optimizer_state_bytes_per_row("EmbOptimType.EXACT_SGD", 8) == 0
    assert cm.HYBRID.memory_bytes(t, 5, 4) == 5 * 32 + 250 * (32 + 4)  # replicas hold no optimizer state


def test_module_overhead_counts_one_splits_exchange_per_stock_type():
    W, peers = 4, 3
    # id check: an all-to-all of 3 int64 per peer; each stock input dist (not DP): 3 int64 splits per peer
    assert cm.module_overhead_bytes(W, {"table_wise", "column_wise", "data_parallel"}) == peers * (24 + 2 * 24)
    assert cm.module_overhead_bytes(W, {"table_wise"}, validate_ids=False) == peers * 24
    # with a hybrid sharding the check rides in its cold ids' header: 4 int32 per peer; the header's spill
    # flag and the rooms' pad travel, checked or not
    rooms = (1 + ROOM_PAD) * 4
    assert cm.module_overhead_bytes(W, {"frequency_hybrid", "table_wise"}) == peers * (16 + rooms + 24)
    assert cm.module_overhead_bytes(W, {"frequency_hybrid"}, validate_ids=False) == peers * rooms
    # per rank the header's two int32 counts per hybrid feature come on top
    per_rank = cm.module_overhead_rank_bytes(W, {"frequency_hybrid"}, hybrid_features=2)
    assert torch.equal(per_rank, torch.full((W,), peers * (16 + rooms + 2 * 2 * 4), dtype=torch.float64))
