"""Which type each table gets, and the hot set chosen for hybrid ones (single process)."""

import pickle

import torch
from torchrec.distributed.planner import ParameterConstraints, Topology

from torchrec_hybrid import FREQUENCY_HYBRID
from torchrec_hybrid.planner import HybridParameterSharding
from torchrec_hybrid.planner import cost_model as cm
from tests.planner.planner_testutils import exact_stats, mixture_probs, plan_for, tables, zipf_probs


def test_tiny_tables_go_data_parallel_and_big_skewed_go_hybrid():
    cfg = tables({"tiny": 20, "big": 100_000})
    st = exact_stats(cfg, {"big": zipf_probs(100_000, 1.1)})
    planner, plan = plan_for(cfg, st)
    assert plan["tiny"].sharding_type == "data_parallel"
    assert plan["big"].sharding_type == FREQUENCY_HYBRID
    assert isinstance(plan["big"], HybridParameterSharding)
    assert plan["big"].hot_rows == plan["big"].hot_ids.numel() > 0


def test_uniform_ids_never_go_hybrid():
    cfg = tables({"a": 100_000, "b": 30_000})
    st = exact_stats(cfg, {})  # uniform
    planner, plan = plan_for(cfg, st)
    assert all(ps.sharding_type != FREQUENCY_HYBRID for ps in plan.values())
    # the replica keeps one row even with H = 0, so the first hot row is nearly free
    assert all(ch.hot_rows <= 1 for ch in planner.hybrid_choices().values())
    # and without statistics at all
    _, plan = plan_for(cfg, None)
    assert all(ps.sharding_type != FREQUENCY_HYBRID for ps in plan.values())


def test_hot_set_grows_with_skew():
    hot, cov = [], []
    for skew in (0.3, 0.6, 0.9):
        cfg = tables({"t": 100_000})
        planner, plan = plan_for(cfg, exact_stats(cfg, {"t": mixture_probs(100_000, skew)}))
        ch = planner.hybrid_choices()["t"]
        hot.append(ch.hot_rows)
        cov.append(ch.coverage)
        assert plan["t"].sharding_type == FREQUENCY_HYBRID
    assert hot[0] < hot[1] < hot[2], hot
    assert cov[0] < cov[1] < cov[2], cov


def test_chosen_h_is_the_brute_force_optimum_of_the_cost_model():
    cfg = tables({"t": 50_000}, dim=32)
    probs = zipf_probs(50_000, 1.2)
    planner, plan = plan_for(cfg, exact_stats(cfg, {"t": probs}))
    counts = planner.frequency_stats.counts("t").to(torch.float64)
    tr = cm.TableTraffic(rows=50_000, dim=32, features=1, pooling=1.0, batch=1024, world=4)
    cov = cm.coverage_from_counts(counts)
    brute = min(range(2000), key=lambda h: (float(cm.hybrid_total_bytes(tr, cov[h], h)), h))
    assert planner.hybrid_choices()["t"].hot_rows == brute


def test_memory_budget_caps_the_hot_sets():
    cfg = tables({"a": 100_000, "b": 100_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1), "b": zipf_probs(100_000, 1.3)})
    free, _ = plan_for(cfg, st)
    h_free = {n: c.hot_rows for n, c in free.hybrid_choices().items()}
    row = 64 * 4
    budget = (sum(h_free.values()) // 2) * row
    capped, _ = plan_for(cfg, st, hot_budget_bytes=budget)
    h_cap = {n: c.hot_rows for n, c in capped.hybrid_choices().items()}
    assert sum(h_cap.values()) * row <= budget
    assert all(h_cap[n] <= h_free[n] for n in h_free) and sum(h_cap.values()) > 0


def test_forced_hybrid_without_stats_uses_sharder_hot_ids_and_default_topology():
    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    cfg = tables({"a": 1000, "b": 500})
    cons = {"a": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID])}
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids={"a": torch.tensor([5, 1, 9])})
    _, plan = plan_for(cfg, None, constraints=cons, sharder=sharder,
                       topology=Topology(world_size=4, compute_device="cpu"))
    assert plan["a"].sharding_type == FREQUENCY_HYBRID
    assert plan["a"].hot_ids.tolist() == [1, 5, 9]
    assert plan["b"].sharding_type != FREQUENCY_HYBRID


def test_plan_pickles_to_the_same_sharding():
    cfg = tables({"t": 100_000, "s": 50})
    _, plan = plan_for(cfg, exact_stats(cfg, {"t": zipf_probs(100_000, 1.1)}))
    again = pickle.loads(pickle.dumps(plan))
    assert again["t"] == plan["t"] and again["s"] == plan["s"]
    assert torch.equal(again["t"].hot_ids, plan["t"].hot_ids)
    assert again["t"].sharding_spec == plan["t"].sharding_spec
