"""Options a user passes are honoured or refused by name, never dropped.

Planner: its search settings reach every candidate plan, bad numbers and misspelt constraint
tables raise, a compute-kernel constraint a frequency_hybrid table cannot meet is refused
(not replaced by FBGEMM's fused kernel). Sharder, statistics and ``refresh_hot_sets``: the
argument combinations and settings they cannot honour raise before anything changes.
"""

import pytest
import torch
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner

from tests.models import build, hot_ids, tables
from tests.multiprocess import run_ranks
from tests.planner.planner_testutils import exact_stats, plan_for, tables as planner_tables, zipf_probs
from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder, refresh_hot_sets
from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology
from torchrec_hybrid.stats import FrequencyStats, HotSetRule
from torchrec_hybrid.types import HotSetError

SIZES = {"big": 20_000, "mid": 8_000, "small": 500, "tiny": 64}


class _EverythingOnRankZero(GreedyPerfPartitioner):
    """A user's partitioner: TorchRec's greedy one, then every shard moved to rank 0."""

    def partition(self, proposal, storage_constraint, hbm_per_device=None):
        plan = super().partition(proposal, storage_constraint)
        for so in plan:
            for shard in so.shards:
                shard.rank = 0
        return plan


def test_a_users_partitioner_places_every_candidate_plan():
    configs = planner_tables(SIZES)
    stats = exact_stats(configs, {n: zipf_probs(r, 1.2) for n, r in SIZES.items()})
    planner, plan = plan_for(configs, stats, world=2, partitioner=_EverythingOnRankZero())
    assert len(planner.candidates) == 3  # TorchRec's plan, the mixed one and the all-hybrid one
    for candidate in planner.candidates:
        for so in candidate.options:
            if so.sharding_type != FREQUENCY_HYBRID:  # a hybrid table has a row block on every rank
                assert {s.rank for s in so.shards} == {0}, (candidate.name, so.name, so.sharding_type)
    assert all(set(ps.ranks) == {0} for ps in plan.values() if ps.sharding_type != FREQUENCY_HYBRID)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_hot_rows=-3), "max_hot_rows must be an int >= 0, got -3"),
    (dict(collective_ms=float("nan")), "collective_ms must be None or a finite number of ms >= 0, got nan"),
    (dict(min_saving=-5), "min_saving must be a share in [0, 1), got -5"),
    (dict(hot_budget_bytes=-100), "hot_budget_bytes must be None or a finite number of bytes >= 0, got -100"),
    (dict(plan_loader=object()), "plan_loader with compare_plans=True"),
])
def test_bad_planner_arguments_raise_by_name(kwargs, words):
    with pytest.raises(ValueError) as e:
        HybridEmbeddingShardingPlanner(topology=gloo_topology(2), batch_size=64, **kwargs)
    assert words in str(e.value)


def test_a_stock_enumerator_and_two_statistics_are_refused():
    topo = gloo_topology(2)
    with pytest.raises(TypeError, match="enumerator must be a HybridEnumerator"):
        HybridEmbeddingShardingPlanner(topology=topo, batch_size=64, enumerator=EmbeddingEnumerator(topo, 64))
    configs = planner_tables({"t": 100})
    one, other = FrequencyStats(configs), FrequencyStats(configs)
    with pytest.raises(ValueError, match="pass the statistics once"):
        HybridEmbeddingShardingPlanner(topology=topo, batch_size=64, stats=one, frequency_stats=other)


def test_constraints_naming_no_table_raise():
    configs = planner_tables({"t0": 1000, "t1": 1000})
    with pytest.raises(ValueError) as e:
        plan_for(configs, world=2, constraints={"t_1": ParameterConstraints(sharding_types=["table_wise"])})
    assert "constraints name table(s) that do not exist: ['t_1']" in str(e.value) and "'t1'" in str(e.value)


@pytest.mark.parametrize("device, kernel", [("cuda", "fused_uvm_caching"), ("cpu", "dense")])
def test_a_compute_kernel_frequency_hybrid_lacks_is_refused_not_replaced(device, kernel):
    configs = planner_tables({"t0": 1000, "t1": 1000})
    forced = {"t0": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID], compute_kernels=[kernel])}
    sharder = HybridEmbeddingBagCollectionSharder(hot_ids={"t0": torch.arange(10)})
    with pytest.raises(ValueError) as e:
        plan_for(configs, world=2, constraints=forced, sharder=sharder,
                 topology=Topology(world_size=2, compute_device=device), compute_costs=None)
    assert f"table 't0': {FREQUENCY_HYBRID} is not possible: its constraints allow compute kernels ['{kernel}'], " \
           "but frequency_hybrid runs on ['fused']" in str(e.value)
    # allowed beside a stock type, the table gets the stock type on the kernel asked for
    allowed = {"t0": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID, "table_wise"],
                                          compute_kernels=["fused_uvm_caching"])}
    _, plan = plan_for(configs, world=2, constraints=allowed, sharder=sharder,
                       topology=Topology(world_size=2, compute_device="cuda"), compute_costs=None)
    assert (plan["t0"].sharding_type, plan["t0"].compute_kernel) == ("table_wise", "fused_uvm_caching")


def test_sharder_hot_set_arguments_that_cannot_all_apply_raise():
    configs = planner_tables({"t": 100})
    stats, rule = exact_stats(configs, {"t": zipf_probs(100, 1.2)}, samples=4096), HotSetRule(coverage=0.5)
    chosen = HybridEmbeddingBagCollectionSharder(stats=stats, hot_set_rule=rule).hot_ids  # both: the rule's pick
    assert torch.equal(chosen["t"], rule.select(stats)["t"]) and 0 < chosen["t"].numel() < 100
    with pytest.raises(ValueError, match="either hot_ids or stats with a hot_set_rule, not both"):
        HybridEmbeddingBagCollectionSharder(hot_ids={"t": torch.arange(3)}, stats=stats, hot_set_rule=rule)
    with pytest.raises(ValueError, match="stats needs hot_set_rule"):
        HybridEmbeddingBagCollectionSharder(stats=stats)
    with pytest.raises(ValueError, match="hot_set_rule needs stats"):
        HybridEmbeddingBagCollectionSharder(hot_set_rule=rule)


@pytest.mark.parametrize("kwargs, words", [
    (dict(sketch_eps=5.0), "sketch_eps is 5.0, expected a number in (0, 1)"),
    (dict(sketch_delta=0.0), "sketch_delta is 0.0, expected a number in (0, 1)"),
    (dict(sketch_capacity=0), "sketch_capacity is 0, expected an int >= 1"),
    (dict(exact_max_rows=-1), "exact_max_rows is -1, expected an int >= 0"),
    (dict(seed=1.5), "seed is 1.5, expected an int"),
])
def test_statistics_settings_a_file_could_not_hold_are_refused(kwargs, words):
    with pytest.raises(ValueError) as e:
        FrequencyStats(planner_tables({"t": 100}), **kwargs)
    assert words in str(e.value)


def _refresh_refusals(rank, world):
    configs = tables()
    model = build(configs, world, {c.name: "hybrid" for c in configs},
                  HybridEmbeddingBagCollectionSharder(hot_ids({"t0": [1, 2], "t1": [0], "t2": [3], "t3": [4]})))
    before = {n: v.clone() for n, v in model.module.hot_ids().items()}
    out = {}
    for name, call in (("unknown", lambda: refresh_hot_sets(model, hot_ids={"t0": torch.tensor([5]),
                                                                             "t_9": torch.tensor([1])})),
                       ("stats", lambda: refresh_hot_sets(model, stats={"t0": [1]}))):
        try:
            call()
            out[name] = "no error"
        except (HotSetError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    after = model.module.hot_ids()
    out["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    return out


def test_refresh_hot_sets_refuses_unknown_tables_and_non_statistics_before_any_change():
    for out in run_ranks(_refresh_refusals, 2):
        assert out["unknown"].startswith("HotSetError: refresh_hot_sets: ['t_9'] are not frequency_hybrid tables")
        assert out["stats"] == "TypeError: refresh_hot_sets: stats must be a FrequencyStats, not dict"
        assert out["unchanged"] is True


def _bare_hybrid_table(rank, world):
    import warnings

    configs = tables()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(configs, world, {"t0": "hybrid"}, HybridEmbeddingBagCollectionSharder(hot_ids({"t_0": [1, 2]})))
    return [str(w.message) for w in caught if "get no hot ids" in str(w.message)]


def test_hot_ids_for_a_table_the_module_lacks_warn_when_a_hybrid_table_gets_none():
    for messages in run_ranks(_bare_hybrid_table, 1):
        assert len(messages) == 1 and "['t0']" in messages[0] and "['t_0']" in messages[0], messages



def _collective_plan_error(rank, world):
    import torch.distributed as dist
    import torchrec

    configs = planner_tables({"t0": 1000, "t1": 1000})
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    forced = {"t0": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID], compute_kernels=["dense"])}
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(world), batch_size=64, constraints=forced,
                                             compute_costs=None)
    try:
        planner.collective_plan(ebc, [HybridEmbeddingBagCollectionSharder(hot_ids={"t0": torch.arange(10)})],
                                dist.GroupMember.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_error_planning_on_rank_0_is_raised_on_every_rank():
    """collective_plan plans on rank 0; the other ranks get its error instead of waiting in the broadcast."""
    messages = run_ranks(_collective_plan_error, 2, timeout=120)
    for m in messages:
        assert "its constraints allow compute kernels ['dense'], but frequency_hybrid runs on ['fused']" in m, m
    assert messages[1].startswith("planning on rank 0 failed: ValueError: "), messages[1]


def _collective_plan_storage_error(rank, world):
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.planner.types import PlannerError

    names = [f"t{i}" for i in range(4)]
    configs = planner_tables({n: 100_000 for n in names})
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    forced = {n: ParameterConstraints(sharding_types=[FREQUENCY_HYBRID], pooling_factors=[20.0]) for n in names}
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(world, ddr_cap=40_000_000), batch_size=512,
                                             constraints=forced, compute_costs=None, hot_budget_bytes=10 ** 9)
    try:
        planner.collective_plan(ebc, [HybridEmbeddingBagCollectionSharder(
            hot_ids={n: torch.arange(50_000) for n in names})], dist.GroupMember.WORLD)
    except PlannerError as e:
        return type(e).__name__, e.error_type.name
    return "no error"


def test_a_planner_error_keeps_its_kind_on_every_rank():
    """The other ranks raise rank 0's PlannerError with its error_type (they got OTHER: a caller
    retrying on INSUFFICIENT_STORAGE, e.g. with fewer hot rows, would retry on rank 0 alone)."""
    assert run_ranks(_collective_plan_storage_error, 2, timeout=120) == [("PlannerError", "INSUFFICIENT_STORAGE")] * 2


@pytest.mark.parametrize("kwargs, words", [
    (dict(row_bounds=[0, 4.7, 10]), "frequency_hybrid(row_bounds=[0, 4.7, 10]): expected ints >= 0"),
    (dict(row_bounds=[0, "5", 10]), "frequency_hybrid(row_bounds=[0, '5', 10]): expected ints >= 0"),
    (dict(cold="table_wise", rank=True), "frequency_hybrid(rank=True): expected an int >= 0"),
    (dict(row_bounds=[0, 5, 9]), "frequency_hybrid(cold='row_wise', row_bounds=[0, 5, 9]) for a 10 x 8 table on 2 "
                                 "ranks: row bounds must run from 0 to 10, got 0 .. 9"),
    (dict(cold="table_wise", rank=3), "frequency_hybrid(cold='table_wise', rank=3) for a 10 x 8 table: rank(s) [3] "
                                      "outside [0, 2)"),
    (dict(cold="column_wise", ranks=[0, 5]), "rank(s) [0, 5] outside [0, 2)"),
    (dict(cold="table_wise", rank=0, pooling_factor=0),
     "frequency_hybrid(pooling_factor=0): expected a finite number > 0"),
    (dict(pooling_factor="3"), "frequency_hybrid(pooling_factor='3'): expected a finite number > 0"),
    # accepted into the plan before: inf, and arrays / tensors / ints failed with NumPy's or torch's own error
    (dict(pooling_factor=float("inf")), "frequency_hybrid(pooling_factor=inf): expected a finite number > 0"),
    (dict(cold="column_wise", ranks=5), "frequency_hybrid(ranks=5): expected a list of ints >= 0"),
    (dict(row_bounds=torch.tensor([0.0, 4.0, 10.0])), "frequency_hybrid(row_bounds=tensor([ 0.,  4., 10.])): expected"),
])
def test_hand_written_hybrid_plans_with_bad_arguments_name_the_call(kwargs, words):
    import torchrec
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    from torchrec_hybrid import frequency_hybrid

    ebc = torchrec.EmbeddingBagCollection(tables=planner_tables({"t": 10}, dim=8), device=torch.device("meta"))
    with pytest.raises(ValueError) as e:
        construct_module_sharding_plan(ebc, {"t": frequency_hybrid(**kwargs)},
                                       sharder=HybridEmbeddingBagCollectionSharder(), local_size=2, world_size=2,
                                       device_type="cpu")
    assert words in str(e.value)


def test_hand_written_row_bounds_may_be_an_integer_tensor():
    import torchrec
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    from torchrec_hybrid import frequency_hybrid

    ebc = torchrec.EmbeddingBagCollection(tables=planner_tables({"t": 10}, dim=8), device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, {"t": frequency_hybrid(row_bounds=torch.tensor([0, 3, 10]))},
                                          sharder=HybridEmbeddingBagCollectionSharder(), local_size=2, world_size=2,
                                          device_type="cpu")
    assert [s.shard_sizes[0] for s in plan["t"].sharding_spec.shards] == [3, 7]


@pytest.mark.parametrize("cold, kw", [("table_wise", dict(rank=1)), ("column_wise", dict(ranks=[0, 1])),
                                      ("row_wise", {})])
def test_a_hand_written_pooling_factor_keeps_the_rest_of_the_entry(cold, kw):
    """``frequency_hybrid(..., pooling_factor=)`` gives the same entry as without it, plus the factor."""
    import torchrec
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    from torchrec_hybrid import frequency_hybrid

    ebc = torchrec.EmbeddingBagCollection(tables=planner_tables({"t": 10}, dim=8), device=torch.device("meta"))
    entries = [construct_module_sharding_plan(ebc, {"t": frequency_hybrid(cold=cold, **kw, **extra)},
                                              sharder=HybridEmbeddingBagCollectionSharder(), local_size=2,
                                              world_size=2, device_type="cpu")["t"]
               for extra in ({}, dict(pooling_factor=3.0))]
    plain, with_factor = entries
    assert with_factor.pooling_factor == 3.0 and with_factor.cold_layout == cold
    assert with_factor.sharding_spec == plain.sharding_spec and with_factor.ranks == plain.ranks
    assert with_factor.sharding_type == plain.sharding_type and with_factor.compute_kernel == plain.compute_kernel


def test_hand_written_hybrid_plans_take_integer_arrays_and_tensors():
    """``row_bounds`` / ``ranks`` as 1-D integer NumPy arrays or tensors make the same plan as lists (ranks as
    a tensor and arrays of row bounds raised "truth value of an array is ambiguous")."""
    import numpy as np
    import torchrec
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    from torchrec_hybrid import frequency_hybrid

    ebc = torchrec.EmbeddingBagCollection(tables=planner_tables({"t": 10}, dim=8), device=torch.device("meta"))

    def spec(**kwargs):
        plan = construct_module_sharding_plan(ebc, {"t": frequency_hybrid(**kwargs)},
                                              sharder=HybridEmbeddingBagCollectionSharder(), local_size=2,
                                              world_size=2, device_type="cpu")
        return [(s.shard_offsets, s.shard_sizes, s.placement) for s in plan["t"].sharding_spec.shards]

    listed = spec(row_bounds=[0, 4, 10])
    assert spec(row_bounds=np.array([0, 4, 10])) == spec(row_bounds=torch.tensor([0, 4, 10])) == listed
    cw = spec(cold="column_wise", ranks=[1, 0])
    assert spec(cold="column_wise", ranks=torch.tensor([1, 0])) == cw
    assert spec(cold="column_wise", ranks=np.array([1, 0])) == cw
