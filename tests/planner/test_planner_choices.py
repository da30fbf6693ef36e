"""Which type each table gets, and the hot set chosen for hybrid ones (single process).

Priced on bytes and collectives (``compute_costs=None``, the network-bound regime) unless a test
says otherwise: whether a table pays for hybrid with compute priced too depends on the machine's
fitted prices (test_planner_compute_costs), not on what these tests check."""

import pickle
import re

import pytest
import torch
import torchrec
from torchrec.distributed.planner import ParameterConstraints, Topology

from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.planner import HybridParameterSharding
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.stats import FrequencyStats
from tests.planner.planner_testutils import exact_stats, mixture_probs, plan_for, tables, zipf_probs

STOCK = "stock: TorchRec's EmbeddingShardingPlanner"  # the comparison's name for TorchRec's plan


def test_big_skewed_tables_go_hybrid():
    cfg = tables({"tiny": 20, "big": 100_000})
    st = exact_stats(cfg, {"big": zipf_probs(100_000, 1.1)})
    planner, plan = plan_for(cfg, st, compute_costs=None)
    assert plan["big"].sharding_type == FREQUENCY_HYBRID
    assert isinstance(plan["big"], HybridParameterSharding)
    assert plan["big"].hot_rows == plan["big"].hot_ids.numel() > 0


def test_uniform_ids_never_cost_more_than_the_stock_plan():
    cfg = tables({"a": 100_000, "b": 30_000})
    st = exact_stats(cfg, {})  # uniform
    planner, plan = plan_for(cfg, st, compute_costs=None)
    stock = [c for c in planner.candidates if c.name.startswith("stock")][0]
    assert max(planner.estimated_rank_bytes()) <= stock.cost["busiest_bytes"]
    # no hybrid table pays on its own: the per-table gate offers none
    assert planner._hybrid_enumerator.offered == set()
    # with this machine's compute prices too, the returned plan keeps stock types where table_wise is balanced
    # (8 tables on 4 ranks; with two tables the hybrid's row blocks spread one owner's lookups over four ranks)
    even = tables({f"t{i}": 100_000 if i % 2 else 30_000 for i in range(8)})
    priced, plan = plan_for(even, exact_stats(even, {}))
    assert all(ps.sharding_type != FREQUENCY_HYBRID for ps in plan.values())
    # and without statistics at all
    _, plan = plan_for(cfg, None)
    assert all(ps.sharding_type != FREQUENCY_HYBRID for ps in plan.values())


def test_hot_set_grows_with_skew():
    hot, cov = [], []
    for skew in (0.3, 0.6, 0.9):
        cfg = tables({"t": 100_000})
        planner, plan = plan_for(cfg, exact_stats(cfg, {"t": mixture_probs(100_000, skew)}), compute_costs=None)
        ch = planner.hybrid_choices()["t"]
        hot.append(ch.hot_rows)
        cov.append(ch.coverage)
        assert plan["t"].sharding_type == FREQUENCY_HYBRID
    assert hot[0] < hot[1] < hot[2], hot
    assert cov[0] < cov[1] < cov[2], cov


def test_chosen_h_is_the_brute_force_optimum_of_the_cost_model():
    cfg = tables({"t": 50_000}, dim=32)
    probs = zipf_probs(50_000, 1.2)
    planner, plan = plan_for(cfg, exact_stats(cfg, {"t": probs}), compute_costs=None)  # the byte model alone
    counts = planner.frequency_stats.counts("t").to(torch.float64)
    tr = cm.TableTraffic(rows=50_000, dim=32, features=1, pooling=1.0, batch=1024, world=4)
    cov = cm.coverage_from_counts(counts)
    brute = min(range(2000), key=lambda h: (float(cm.HYBRID.mean_bytes(tr, cov[h], h)), h))
    assert planner.hybrid_choices()["t"].hot_rows == brute


def test_memory_budget_caps_the_hot_sets():
    cfg = tables({"a": 100_000, "b": 100_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1), "b": zipf_probs(100_000, 1.3)})
    free, _ = plan_for(cfg, st, compute_costs=None)
    h_free = {n: c.hot_rows for n, c in free.hybrid_choices().items()}
    row = 64 * 4
    budget = (sum(h_free.values()) // 2) * row
    capped, _ = plan_for(cfg, st, hot_budget_bytes=budget, compute_costs=None)
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
    _, plan = plan_for(cfg, exact_stats(cfg, {"t": zipf_probs(100_000, 1.1)}), compute_costs=None)
    again = pickle.loads(pickle.dumps(plan))
    assert again["t"] == plan["t"] and again["s"] == plan["s"]
    assert torch.equal(again["t"].hot_ids, plan["t"].hot_ids)
    assert again["t"].sharding_spec == plan["t"].sharding_spec


def test_multi_hot_bags_pick_table_wise_cold():
    """Long bags: row-wise cold would return a partial sum per owner a bag touches.

    Priced for a network-bound cluster (bytes and collectives, ``compute_costs=None``): with
    this CPU box's compute prices no table pays for hybrid at all (test_planner_compute_costs)."""
    cfg = tables({f"m{i}": 100_000 for i in range(4)})
    st = exact_stats(cfg, {c.name: zipf_probs(100_000, 1.1) for c in cfg})
    cons = {c.name: ParameterConstraints(pooling_factors=[30.0]) for c in cfg}
    planner, plan = plan_for(cfg, st, constraints=cons, batch=512, compute_costs=None)
    assert all(ps.sharding_type == FREQUENCY_HYBRID and ps.cold_layout == "table_wise" for ps in plan.values())
    # the plan says how many ids a bag holds, so the owners look these tables up in a TBE call of their own
    assert all(ps.pooling_factor == 30.0 for ps in plan.values())
    owners = {max(range(4), key=lambda r: ps.sharding_spec.shards[r].shard_sizes[0]) for ps in plan.values()}
    assert owners == {0, 1, 2, 3}  # identical tables spread over the ranks
    # one-hot, the same tables: both layouts cost the same bytes, and every table gets the same choice
    _, plan1 = plan_for(cfg, st, compute_costs=None)
    assert len({(ps.sharding_type, ps.hot_rows) for ps in plan1.values()}) == 1


def test_a_table_too_hot_for_one_rank_is_cut_in_column_slices():
    """One multi-hot table carries most of the traffic: table-wise cold would load its owner with
    more than a rank's share, row-wise cold returns a partial per owner; the planner cuts it in
    column slices (one cold owner per slice). Tables of a rank's share or less are not cut."""
    cfg = tables({"hot": 100_000, **{f"s{i}": 100_000 for i in range(3)}})
    st = exact_stats(cfg, {c.name: zipf_probs(100_000, 1.1) for c in cfg})
    cons = {"hot": ParameterConstraints(pooling_factors=[30.0])}
    planner, plan = plan_for(cfg, st, constraints=cons, batch=512, compute_costs=None)
    assert plan["hot"].cold_layout == "column_wise", plan["hot"]
    shards = plan["hot"].sharding_spec.shards  # stock column_wise's spec: one shard per slice
    assert [s.shard_offsets for s in shards] == [[0, 32 * i] for i in range(len(shards))] and len(shards) >= 2
    assert all(getattr(plan[f"s{i}"], "cold_layout", None) != "column_wise" for i in range(3))
    # six identical tables: none is too hot for one rank, so none is cut
    cfg6 = tables({f"m{i}": 100_000 for i in range(6)})
    st6 = exact_stats(cfg6, {c.name: zipf_probs(100_000, 1.1) for c in cfg6})
    cons6 = {c.name: ParameterConstraints(pooling_factors=[30.0]) for c in cfg6}
    planner6, plan6 = plan_for(cfg6, st6, constraints=cons6, batch=512, compute_costs=None)
    assert all(ps.cold_layout != "column_wise" for ps in plan6.values())
    assert all("column_wise" not in ch for ch in planner6._hybrid_enumerator.choices.values())


def test_frequency_sorted_ids_stay_balanced():
    cfg = tables({f"s{i}": 100_000 for i in range(3)})
    st = exact_stats(cfg, {c.name: zipf_probs(100_000, 1.1) for c in cfg}, sorted_ids=True)
    planner, plan = plan_for(cfg, st, compute_costs=None)
    est = torch.tensor(planner.estimated_rank_bytes())
    assert float(est.max() / est.mean()) <= 1.15
    for ps in plan.values():
        if ps.cold_layout == "row_wise":  # the hottest cold rows are the first: the first block is short
            sizes = [s.shard_sizes[0] for s in ps.sharding_spec.shards]
            assert sizes[0] < sizes[-1], sizes


def test_sharder_offering_only_frequency_hybrid_gets_only_that():
    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    class OnlyHybrid(HybridEmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return [FREQUENCY_HYBRID]

    cfg = tables({"a": 100_000, "b": 1000})
    _, plan = plan_for(cfg, exact_stats(cfg, {}), sharder=OnlyHybrid())  # uniform ids: stock would win
    assert {ps.sharding_type for ps in plan.values()} == {FREQUENCY_HYBRID}


def test_the_comparison_is_logged_once_under_the_names_of_its_candidates(caplog):
    # the all-hybrid candidate comes from an inner planner (compare_plans=False) whose one
    # candidate is its mixed plan: it must not log a one-line "comparison" under that name
    cfg = tables({"tiny": 20, "big": 100_000})
    st = exact_stats(cfg, {"big": zipf_probs(100_000, 1.1)})
    with caplog.at_level("INFO", logger="torchrec_hybrid.planner.planner"):
        planner, _ = plan_for(cfg, st, compute_costs=None)
    headers = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan candidates")]
    assert len(headers) == 1 and len(planner.candidates) == 3
    logged = [r.getMessage() for r in caplog.records if r.getMessage().lstrip("* ").startswith(
        ("hybrid planner:", "stock:", "every eligible"))]
    assert logged == planner.comparison_table()[1:]
    with caplog.at_level("INFO", logger="torchrec_hybrid.planner.planner"):
        caplog.clear()
        single, _ = plan_for(cfg, st, compute_costs=None, compare_plans=False)
    assert len(single.candidates) == 1
    assert not [r for r in caplog.records if r.getMessage().startswith("plan candidates")]


def test_small_tables_forced_hybrid_get_a_row_on_every_rank():
    """Even row-wise cold blocks of a table with at least W rows leave no rank without rows (stock
    ceil blocks of 6 rows on 4 ranks would be 2, 2, 2, 0, which sharding refuses)."""
    from torchrec_hybrid import row_blocks

    for rows, world in ((6, 4), (9, 4), (10, 8), (40, 4)):
        _, mp = plan_for(tables({"t": rows}, dim=16), world=world, compute_costs=None,
                         constraints={"t": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID])})
        ps = mp["t"]
        (sl,) = row_blocks.slices_of("t", ps, rows, 16, world)  # what sharding reads; raises on an empty block
        assert min(b - a for a, b in zip(sl.bounds, sl.bounds[1:])) >= 1, (rows, world, sl.bounds)


def test_a_second_plan_call_prices_its_own_module():
    """The workload a plan is priced on is the module of that call, not the first call's."""
    planner, _ = plan_for(tables({"t": 200_000}), compute_costs=None)
    big = planner.estimated_rank_bytes()
    fresh, _ = plan_for(tables({"t": 100}), compute_costs=None)
    ebc = torchrec.EmbeddingBagCollection(tables=tables({"t": 100}), device=torch.device("meta"))
    planner.plan(ebc, [HybridEmbeddingBagCollectionSharder()])
    assert planner.traffic_table().traffic["t"].rows == 100
    assert planner.estimated_rank_bytes() == fresh.estimated_rank_bytes() != big


def test_a_users_enumerator_sizes_every_candidate():
    """Statistics given on a user's HybridEnumerator size the all-hybrid candidate too (it was planned
    without them: no hot rows), and the planner refuses a second, different statistics object."""
    from torchrec.distributed.planner.stats import NoopEmbeddingStats

    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, HybridEnumerator, gloo_topology

    cfgs = tables({"a": 20000, "c": 20000})
    st = exact_stats(cfgs, {"a": zipf_probs(20000, 1.2), "c": zipf_probs(20000, 0.3)})
    ebc = torchrec.EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    topo = gloo_topology(4)

    def candidates(**kw):
        p = HybridEmbeddingShardingPlanner(topology=topo, batch_size=1024, compute_costs=None,
                                           stats=[NoopEmbeddingStats()], **kw)
        p.plan(ebc, [HybridEmbeddingBagCollectionSharder()])
        return {c.name: {so.name: getattr(getattr(so, "hybrid_choice", None), "hot_rows", None) for so in c.options}
                for c in p.candidates}

    by_planner = candidates(frequency_stats=st)
    by_enumerator = candidates(enumerator=HybridEnumerator(topo, 1024, frequency_stats=st))
    assert by_enumerator == by_planner
    assert by_planner["every eligible table frequency_hybrid"]["a"] > 0
    with pytest.raises(ValueError, match="two different FrequencyStats"):
        HybridEmbeddingShardingPlanner(topology=topo, batch_size=1024, frequency_stats=exact_stats(cfgs, {}),
                                       enumerator=HybridEnumerator(topo, 1024, frequency_stats=st))


def test_the_communication_table_names_each_tables_best_stock_type():
    from torchrec_hybrid.planner.stats import communication_table

    cfgs = tables({"a": 20000, "b": 20000})
    planner, _ = plan_for(cfgs, exact_stats(cfgs, {n: zipf_probs(20000, 1.2) for n in ("a", "b")}),
                          compute_costs=None)
    choices = planner.hybrid_choices()
    assert set(choices) == {"a", "b"}
    for ch in choices.values():
        assert ch.best_stock_type == "table_wise" and ch.best_stock_bytes > 0 and ch.best_stock_cost > 0
    rows = [line.split() for line in communication_table(planner.planned_options(), 4)]
    assert [r[-2] for r in rows if r[0] in ("a", "b")] == ["table_wise", "table_wise"]


def test_a_candidate_that_finds_no_plan_is_left_out_of_the_comparison(caplog):
    """A rank's memory fits the hybrid's row-wise cold shards but no table_wise shard of the largest table:
    TorchRec's own planner raises there, and the comparison goes on without its plan (it made
    ``plan`` raise, though the partitioner's plan fits), saying so."""
    from torchrec.distributed.planner.types import PlannerError

    from torchrec_hybrid.planner import gloo_topology
    from tests.planner.planner_testutils import plan_for as plan_with

    cfg = tables({"a": 100_000, "b": 50_000, "c": 1_000})
    st = exact_stats(cfg, {n: zipf_probs(c.num_embeddings, 1.1) for n, c in zip("abc", cfg)})
    topo = dict(topology=gloo_topology(4, ddr_cap=20_000_000))
    with pytest.raises(PlannerError):  # TorchRec's planner on its own
        torchrec.distributed.planner.EmbeddingShardingPlanner(topology=topo["topology"], batch_size=1024).plan(
            torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
            [torchrec.distributed.embeddingbag.EmbeddingBagCollectionSharder()])
    with caplog.at_level("WARNING", logger="torchrec_hybrid.planner.planner"):
        planner, plan = plan_with(cfg, st, compute_costs=None, **topo)
    assert "stock: TorchRec's EmbeddingShardingPlanner found no plan: " in caplog.text
    assert not any(c.name.startswith("stock") for c in planner.candidates)
    # the comparison the planner logs says so too (it listed the compared candidates alone)
    assert [line for line in planner.comparison_table() if "left out" in line] == [
        f"  stock: TorchRec's EmbeddingShardingPlanner: no plan; left out: {planner.left_out[STOCK]}"]
    assert planner.left_out[STOCK].startswith("found no plan: ")
    assert planner.chosen in planner.candidates
    assert all(ps.sharding_type == FREQUENCY_HYBRID for ps in plan.values())
    _, alone = plan_with(cfg, st, compute_costs=None, compare_plans=False, **topo)
    assert {n: (ps.sharding_type, ps.ranks) for n, ps in plan.items()} == \
        {n: (ps.sharding_type, ps.ranks) for n, ps in alone.items()}


@pytest.mark.parametrize("case", ["output_dtype_constraint", "gradient_clipping", "unverified_optimizer"])
def test_tables_whose_fused_options_hybrid_refuses_are_not_planned_hybrid(case):
    """The planner offers frequency_hybrid only where sharding accepts it: a table whose fused options
    (the sharder's, or per table from its constraints) the hybrid refuses gets a stock type - it planned
    them hybrid, and sharding that plan raised - and forcing hybrid there names the option."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.types import DataType

    from torchrec_hybrid.sharded_ebc import check_hybrid_supported

    cfg = tables({"a": 100_000, "b": 50_000})
    st = exact_stats(cfg, {n: zipf_probs(c.num_embeddings, 1.1) for n, c in zip("ab", cfg)})
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    if case == "gradient_clipping":
        fused.update(gradient_clipping=True, max_gradient=1.0)
    if case == "unverified_optimizer":  # FBGEMM's CUDA kernels run it; nothing verified it with frequency_hybrid
        fused.update(optimizer=EmbOptimType.ADAM)
    table_kw = dict(output_dtype=DataType.FP16) if case == "output_dtype_constraint" else {}
    sharder = HybridEmbeddingBagCollectionSharder(fused_params=fused)
    clean = HybridEmbeddingBagCollectionSharder(fused_params={**fused, "gradient_clipping": False,
                                                              "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    _, hybrid_if_clean = plan_for(cfg, st, compute_costs=None, sharder=clean)
    assert {ps.sharding_type for ps in hybrid_if_clean.values()} == {FREQUENCY_HYBRID}  # the option alone decides
    _, plan = plan_for(cfg, st, compute_costs=None, sharder=sharder,
                       constraints={n: ParameterConstraints(**table_kw) for n in "ab"})
    assert FREQUENCY_HYBRID not in {ps.sharding_type for ps in plan.values()}
    check_hybrid_supported(cfg, plan, sharder.fused_params, None)  # what sharding runs: accepted
    option = {"output_dtype_constraint": "output_dtype", "gradient_clipping": "gradient_clipping",
              "unverified_optimizer": "optimizer=ADAM"}[case]
    refused = f"table 'a': {FREQUENCY_HYBRID} is not possible: its fused options .*{option}"
    with pytest.raises(ValueError, match=refused):
        plan_for(cfg, st, compute_costs=None, sharder=sharder,
                 constraints={n: ParameterConstraints(sharding_types=[FREQUENCY_HYBRID], **table_kw) for n in "ab"})


def test_hybrid_beside_a_stock_type_the_device_does_not_offer():
    """``sharding_types=[frequency_hybrid, row_wise]`` on CPU, where TorchRec's EBC sharder offers no
    row_wise: the table goes frequency_hybrid (the planner raised TorchRec's "No available sharding
    type" from its stock enumeration, and from TorchRec's own planner as the stock candidate), as with
    [frequency_hybrid] alone; with [frequency_hybrid, data_parallel] the stock type is still weighed."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    assert "row_wise" not in EmbeddingBagCollectionSharder().sharding_types("cpu")
    cfg = tables({"a": 100_000, "b": 20_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1)})
    _, alone = plan_for(cfg, st, compute_costs=None, constraints={"a": ParameterConstraints(
        sharding_types=[FREQUENCY_HYBRID])})
    planner, plan = plan_for(cfg, st, compute_costs=None, constraints={"a": ParameterConstraints(
        sharding_types=[FREQUENCY_HYBRID, "row_wise"])})
    assert plan["a"].sharding_type == FREQUENCY_HYBRID
    assert (plan["a"].ranks, plan["a"].hot_rows) == (alone["a"].ranks, alone["a"].hot_rows)
    assert not any(c.name.startswith("stock") for c in planner.candidates)  # it would break the constraint
    planner, _ = plan_for(cfg, st, compute_costs=None, constraints={"a": ParameterConstraints(
        sharding_types=[FREQUENCY_HYBRID, "data_parallel"])})
    assert any(c.name.startswith("stock") for c in planner.candidates)


@pytest.mark.parametrize("constraint", [dict(batch_sizes=[8192]), dict(num_poolings=[8.0])])
def test_per_feature_batch_sizes_and_poolings_are_priced(constraint):
    """``batch_sizes`` / ``num_poolings`` in a table's constraints price its bags as TorchRec's perf
    estimator counts them (batch x poolings per feature): one table at batch 1024 with 8192 bags per
    feature is priced as at batch 8192 (they were ignored: priced at 1024, 8x too few bytes)."""
    cfg = tables({"a": 100_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1)})
    constrained, _ = plan_for(cfg, st, batch=1024, compute_costs=None,
                              constraints={"a": ParameterConstraints(**constraint)})
    wide, _ = plan_for(cfg, st, batch=8192, compute_costs=None)
    plain, _ = plan_for(cfg, st, batch=1024, compute_costs=None)
    assert constrained.traffic_table().traffic["a"].bags == wide.traffic_table().traffic["a"].bags == 8192
    assert constrained.estimated_rank_bytes() == pytest.approx(wide.estimated_rank_bytes(), rel=1e-9)
    assert constrained.chosen.cost["cost_ms"] == pytest.approx(wide.chosen.cost["cost_ms"], rel=1e-9)
    assert max(constrained.estimated_rank_bytes()) > 4 * max(plain.estimated_rank_bytes())


def test_every_rank_holds_the_hot_replicas_of_table_wise_cold_tables():
    """Multi-hot tables forced hybrid go table-wise cold; every rank holds every table's hot replica,
    but the partitioner counts it on the owner alone: the planner adds it to each rank
    (cost_model.plan_rank_memory) and refuses a plan that then fits no rank's memory (it returned one
    needing ~80 MB per rank on 60 MB ranks)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.planner.types import PlannerError

    from torchrec_hybrid.planner import gloo_topology
    from torchrec_hybrid.planner.cost_model import plan_rank_memory

    names = [f"t{i}" for i in range(4)]
    cfg = tables({n: 100_000 for n in names})
    hot = {n: torch.arange(50_000) for n in names}
    sharder = HybridEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}, hot_ids=hot)
    cons = {n: ParameterConstraints(sharding_types=[FREQUENCY_HYBRID], pooling_factors=[20.0]) for n in names}
    planner, plan = plan_for(cfg, None, batch=512, compute_costs=None, constraints=cons, sharder=sharder,
                             topology=gloo_topology(4, ddr_cap=1_000_000_000))
    assert {ps.cold_layout for ps in plan.values()} == {"table_wise"}
    replicas = sum(50_000 * 64 * 4 for _ in names)  # every table's hot rows, fp32, on every rank
    BUDGET = 10 ** 9  # the hot-row budget does not bind here (a quarter of a small rank would: refused first)
    counted = [0.0] * 4
    for so in planner.planned_options():
        for shard in so.shards:
            counted[shard.rank] += shard.storage.ddr
    assert min(counted) < replicas  # what the partitioner saw on a non-owner
    assert min(plan_rank_memory(planner.planned_options(), 4, on_device=False).tolist()) > replicas
    refused = r"no plan fits the ranks' memory: .*over the [\d.]+ MB of its DDR left"
    with pytest.raises(PlannerError, match=refused) as e:
        plan_for(cfg, None, batch=512, compute_costs=None, constraints=cons, sharder=sharder,
                 topology=gloo_topology(4, ddr_cap=60_000_000), hot_budget_bytes=BUDGET)
    assert e.value.error_type.name == "INSUFFICIENT_STORAGE"
    # the partitioner packs shards into the caps left after the storage reservation: a plan within the
    # raw 84 MB but over what the reservation leaves of it is refused too (it was checked against the raw cap)
    assert max(plan_rank_memory(planner.planned_options(), 4, on_device=False).tolist()) < 84_000_000
    with pytest.raises(PlannerError, match=r"over the [\d.]+ MB of its DDR left after the storage reservation"):
        plan_for(cfg, None, batch=512, compute_costs=None, constraints=cons, sharder=sharder,
                 topology=gloo_topology(4, ddr_cap=84_000_000), hot_budget_bytes=BUDGET)


def test_a_candidate_over_a_ranks_memory_is_left_out_and_the_comparison_says_why():
    """Skewed multi-hot tables: the partitioner's plan makes them hybrid, table-wise cold, and every rank's
    copies of the four hot replicas over-fill 34 MB ranks, though the partitioner counted each on its owner
    alone; TorchRec's plan fits and is returned. The comparison marks the candidate left out, with the rank
    and the sizes (only a warning said so: the logged comparison listed it like the others)."""
    from torchrec_hybrid.planner import gloo_topology
    from torchrec_hybrid.planner.cost_model import plan_rank_memory

    names = [f"t{i}" for i in range(4)]
    cfg = tables({n: 100_000 for n in names})
    st = exact_stats(cfg, {n: zipf_probs(100_000, 1.2) for n in names})
    cons = {n: ParameterConstraints(pooling_factors=[20.0]) for n in names}
    kw = dict(batch=512, compute_costs=None, constraints=cons, max_hot_rows=200_000)
    roomy, _ = plan_for(cfg, st, topology=gloo_topology(4, ddr_cap=1_000_000_000), **kw)
    mixed = "hybrid planner: stock + hybrid options"
    assert roomy.chosen.name == mixed and not roomy.left_out  # it wins where it fits
    planner, plan = plan_for(cfg, st, topology=gloo_topology(4, ddr_cap=34_000_000), **kw)
    assert planner.chosen.name == STOCK and set(planner.left_out) == {mixed}
    assert re.fullmatch(r"rank \d would hold [\d.]+ MB, over the [\d.]+ MB of its DDR left after the storage "
                        r"reservation", planner.left_out[mixed])
    lines = planner.comparison_table()
    assert [line for line in lines if "left out" in line] == [lines[1]]
    assert lines[1].startswith(f"  {mixed}: ") and lines[1].endswith(f"; left out: {planner.left_out[mixed]}")
    assert lines[2].startswith(f"* {STOCK}: ")
    assert {ps.sharding_type for ps in plan.values()} == {"table_wise"}
    assert max(plan_rank_memory(planner.planned_options(), 4, on_device=False).tolist()) <= 34_000_000
    # alone (compare_plans=False: also how the all-hybrid candidate is planned) the error names the rank, not a
    # candidate the caller never asked for
    from torchrec.distributed.planner.types import PlannerError

    with pytest.raises(PlannerError) as alone:
        plan_for(cfg, st, topology=gloo_topology(4, ddr_cap=34_000_000), compare_plans=False, **kw)
    assert str(alone.value).startswith(f"no plan fits the ranks' memory: {planner.left_out[mixed]}. ")


def test_a_candidate_sending_more_than_stock_on_its_busiest_rank_is_marked_left_out():
    """Given hot sets the bags rarely hit: the all-hybrid candidate syncs their rows every step and sends
    more than TorchRec's plan on its busiest rank, so it is not eligible; the comparison says why."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    names = [f"t{i}" for i in range(4)]
    cfg = tables({n: 100_000 for n in names})
    sharder = HybridEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        hot_ids={n: torch.arange(2000) for n in names})
    with pytest.warns(UserWarning, match="hot_ids are ignored for 4 table"):  # the plan returned has no hybrid
        planner, _ = plan_for(cfg, None, batch=512, compute_costs=None, sharder=sharder,
                              constraints={n: ParameterConstraints(pooling_factors=[1.0]) for n in names})
    all_hybrid = next(c for c in planner.candidates if c.name == "every eligible table frequency_hybrid")
    stock = next(c for c in planner.candidates if c.name == STOCK)
    assert all_hybrid.cost["busiest_bytes"] > stock.cost["busiest_bytes"]
    assert planner.left_out == {all_hybrid.name: "more busiest-rank bytes than the stock plan"}
    assert planner.chosen is not all_hybrid
    assert [line for line in planner.comparison_table() if line.endswith(
        "; left out: more busiest-rank bytes than the stock plan")][0].startswith(f"  {all_hybrid.name}: ")


def test_an_optimizer_applied_in_backward_is_counted_in_hybrid_storage():
    """``apply_optimizer_in_backward(torch.optim.Adagrad, ...)``: the hybrid options' storage counts its
    state as for the fused EXACT_ADAGRAD (a full row of state per row; it counted none), as TorchRec's
    storage estimator counts it for stock options."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.planner.stats import NoopEmbeddingStats
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology

    cfg = tables({"a": 100_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1)})

    def storage(in_backward: bool, sharder_optimizer=None):
        ebc = torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta"))
        fused = {} if in_backward else {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.01}
        if sharder_optimizer is not None:
            fused = {"optimizer": sharder_optimizer, "learning_rate": 0.01}
        if in_backward:
            apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.01})
        planner = HybridEmbeddingShardingPlanner(
            topology=gloo_topology(4), batch_size=1024, frequency_stats=st, compute_costs=None,
            constraints={"a": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID])}, stats=[NoopEmbeddingStats()])
        planner.plan(ebc, [HybridEmbeddingBagCollectionSharder(fused_params=fused)])
        return [s.storage.ddr for so in planner.planned_options() for s in so.shards]

    fused, in_backward = storage(False), storage(True)
    assert in_backward == fused
    assert min(fused) > 2 * 25_000 * 64 * 4  # a quarter of the rows, weights and as much state
    # beside a fused optimizer of the sharder's, the one applied in backward is what sharding builds
    # (TorchRec's merge_fused_params): its state is counted, not the sharder's (SGD: none)
    assert storage(True, sharder_optimizer=EmbOptimType.EXACT_SGD) == fused


def test_output_dtype_fp32_in_any_form_is_accepted():
    """``ParameterConstraints(output_dtype=DataType.FP32)`` (the field's own type) keeps frequency_hybrid
    (it was refused as if FP32 output were not: only SparseType.FP32 / torch.float32 were accepted)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.types import DataType

    from torchrec_hybrid.sharded_ebc import check_hybrid_supported, unsupported_fused_options

    for fp32 in (DataType.FP32, SparseType.FP32, torch.float32):
        assert unsupported_fused_options({"output_dtype": fp32}) == []
    assert unsupported_fused_options({"output_dtype": DataType.FP16})
    cfg = tables({"a": 100_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1)})
    _, plan = plan_for(cfg, st, compute_costs=None,
                       constraints={"a": ParameterConstraints(output_dtype=DataType.FP32)})
    assert plan["a"].sharding_type == FREQUENCY_HYBRID
    check_hybrid_supported(cfg, plan, {}, None)


def test_hybrid_or_a_stock_type_the_kernel_constraint_excludes():
    """[frequency_hybrid, data_parallel] with compute_kernels [fused]: data_parallel has no fused kernel,
    so TorchRec's planner finds the table no option and raises RuntimeError ("No available sharding
    type"); the comparison goes on without it (plan() raised) and the table goes hybrid, as with
    compare_plans=False."""
    cfg = tables({"a": 100_000, "b": 20_000})
    st = exact_stats(cfg, {"a": zipf_probs(100_000, 1.1)})
    cons = {"a": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID, "data_parallel"], compute_kernels=["fused"])}
    planner, plan = plan_for(cfg, st, compute_costs=None, constraints=cons)
    _, alone = plan_for(cfg, st, compute_costs=None, constraints=cons, compare_plans=False)
    assert plan["a"].sharding_type == alone["a"].sharding_type == FREQUENCY_HYBRID
    assert not any(c.name.startswith("stock") for c in planner.candidates)


def test_a_shared_table_with_one_batch_size_plans_with_statistics():
    """A table of two features with ``batch_sizes=[8192]`` (TorchRec plans it): the measured pooling
    factors, one per feature, took the single batch size along (TorchRec asserted unequal lengths),
    each feature's bags priced at 8192."""
    cfg = [torchrec.EmbeddingBagConfig(name="a", embedding_dim=64, num_embeddings=100_000,
                                       feature_names=["f1", "f2"])]
    st = FrequencyStats(cfg)
    g = torch.Generator().manual_seed(0)
    st.update(torchrec.KeyedJaggedTensor(keys=["f1", "f2"], values=torch.randint(0, 1000, (4096,), generator=g),
                                         lengths=torch.ones(4096, dtype=torch.int32), stride=2048))
    planner, _ = plan_for(cfg, st, compute_costs=None, constraints={"a": ParameterConstraints(batch_sizes=[8192])})
    assert planner.traffic_table().traffic["a"].bags == 2 * 8192


def test_the_sharders_fixed_hot_sets_are_held_to_max_hot_rows_and_the_budget():
    """A sharder's hot_ids larger than max_hot_rows, or over the hot-row budget alone, are refused,
    naming the table and the setting (a 3,000-row set was planned with max_hot_rows=100, and 7.7x over
    the budget while the statistics-sized table was squeezed to 0 rows)."""
    cfg = tables({"a": 100_000, "b": 100_000})
    st = exact_stats([cfg[1]], {"b": zipf_probs(100_000, 1.1)})
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids={"a": torch.arange(3000)})
    forced = {n: ParameterConstraints(sharding_types=[FREQUENCY_HYBRID]) for n in "ab"}
    _, plan = plan_for(cfg, st, compute_costs=None, sharder=sharder, constraints=forced)
    assert plan["a"].hot_rows == 3000  # within the defaults: the set as given
    with pytest.raises(ValueError, match="table 'a': the sharder's hot_ids hold 3000 rows, more than max_hot_rows=100"):
        plan_for(cfg, st, compute_costs=None, sharder=sharder, constraints=forced, max_hot_rows=100)
    with pytest.raises(ValueError, match=r"the sharder's hot_ids \(a: 3000 rows\) need \d+ B per rank .* over the "
                                         r"hot-row budget of 100000 B"):
        plan_for(cfg, st, compute_costs=None, sharder=sharder, constraints=forced, hot_budget_bytes=100_000)


def test_the_stats_loggers_describe_the_plan_returned_once():
    """The planner's Stats loggers log once, the plan it returns (they logged the partitioner's mixed
    plan, and the all-hybrid planner's, also when TorchRec's plan won): here TorchRec's plan wins
    under this box's prices (uniform ids), and the all-hybrid one under network prices (Zipf ids)."""
    from torchrec.distributed.planner.types import Stats

    class Calls(Stats):
        def __init__(self):
            self.plans = []

        def log(self, sharding_plan, *args, **kwargs):
            self.plans.append(sharding_plan)
            self.debug = kwargs.get("debug")

    skewed = tables({"a": 100_000, "b": 60_000})
    st = exact_stats(skewed, {n: zipf_probs(c.num_embeddings, 1.1) for n, c in zip("ab", skewed)}, samples=1 << 13)
    even = tables({f"t{i}": 100_000 if i % 2 else 30_000 for i in range(8)})  # uniform ids
    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology

    for costs, winner, cfg, st in (("default", "stock", even, exact_stats(even, {})), (None, "hybrid", skewed, st)):
        calls = Calls()
        planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(4), batch_size=1024, frequency_stats=st,
                                                 compute_costs=costs, stats=[calls], debug=False)
        planner.plan(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
                     [HybridEmbeddingBagCollectionSharder()])
        assert len(planner.candidates) > 1 and planner.chosen.name.startswith(winner)
        assert calls.plans == [planner.chosen.plan], (costs, len(calls.plans))
        assert calls.debug is False  # this planner's debug, whichever candidate's planner made the plan
