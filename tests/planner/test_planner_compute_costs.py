"""The compute side of the cost model: work per rank, its prices, and what the planner does with them."""

import dataclasses
import json
import pathlib

import pytest
import torch
import torchrec

from torchrec_hybrid import FREQUENCY_HYBRID, _compat
from torchrec_hybrid.planner import compute_costs
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner.estimators import StepPerfModel
from tests.planner.planner_testutils import exact_stats, plan_for, tables, zipf_probs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _traffic(pooling: float = 1.0, world: int = 4) -> cm.TableTraffic:
    return cm.TableTraffic(rows=50_000, dim=32, features=2, pooling=pooling, batch=512, world=world)


@pytest.mark.parametrize("pooling", [1.0, 12.0])
@pytest.mark.parametrize("virtual", [None, [True, False, False, True]])
def test_mean_work_is_the_mean_of_the_rank_work(pooling, virtual):
    t = _traffic(pooling)
    shares = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    v = None if virtual is None else torch.tensor(virtual)
    hot = 400
    per_rank = cm.HYBRID.rank_work(t, 0.6, shares, shares * hot, virtual=v)  # hot rows spread as the cold lookups
    mean = cm.HYBRID.mean_work(t, torch.tensor(0.6), torch.tensor(float(hot)), shares, virtual=v)
    torch.testing.assert_close(per_rank.mean(0), mean)
    if v is not None:  # and the owners' extra is in it
        assert float(mean[cm.WORK_TERMS.index("lookup")]) > float(
            cm.HYBRID.mean_work(t, torch.tensor(0.6), torch.tensor(float(hot)), shares)[cm.WORK_TERMS.index("lookup")])


def test_table_wise_work_sits_on_the_owner_and_sums_like_row_wise():
    t = _traffic(3.0)
    tw = cm.model("table_wise").rank_work(t, owner=2)
    lookup = cm.WORK_TERMS.index("lookup")
    assert tw[2, lookup] == t.world * t.lookups * t.dim and tw[[0, 1, 3], lookup].eq(0).all()
    # the same lookups in total as a row-wise table, spread instead of on one rank
    torch.testing.assert_close(tw[:, lookup].sum(), cm.model("row_wise").rank_work(t)[:, lookup].sum())


def test_prices_are_linear_and_zero_prices_cost_nothing():
    work = torch.rand(4, len(cm.WORK_TERMS), dtype=torch.float64) * 1e6
    sent = torch.rand(4, dtype=torch.float64) * 1e6
    assert cm.ComputeCosts().ms(work, sent).eq(0).all()
    c = cm.ComputeCosts(lookup=1.0, vector_hybrid=2.0, group_hybrid_ms=0.5, ns_per_byte=0.1)
    torch.testing.assert_close(c.ms(2 * work, 2 * sent), 2 * c.ms(work, sent))
    i, j, g = (cm.WORK_TERMS.index(n) for n in ("lookup", "vector_hybrid", "group_hybrid"))
    expect = (work[:, i] * 1.0 + work[:, j] * 2.0 + sent * 0.1) * 1e-6 + work[:, g] * 0.5
    torch.testing.assert_close(c.ms(work, sent), expect)


def _skewed():
    cfg = tables({"small": 2_000, "big": 100_000})
    return cfg, exact_stats(cfg, {"big": zipf_probs(100_000, 1.1), "small": zipf_probs(2_000, 1.1)})


def test_the_plan_cost_adds_the_busiest_ranks_compute():
    cfg, st = _skewed()
    free, _ = plan_for(cfg, st, compute_costs=None)
    priced, _ = plan_for(cfg, st, compute_costs=cm.ComputeCosts(lookup=1.0, vector_stock=1.0, vector_hybrid=1.0))
    for c in priced.candidates:
        assert c.cost["compute_ms"] > 0
        assert c.cost["cost_ms"] >= c.cost["bytes_ms"] + c.cost["compute_ms"] - 1e-9
    assert all(c.cost["compute_ms"] == 0 for c in free.candidates)


def test_expensive_hybrid_compute_makes_the_planner_keep_stock_types():
    cfg, st = _skewed()
    _, cheap = plan_for(cfg, st, compute_costs=None)
    assert cheap["big"].sharding_type == FREQUENCY_HYBRID
    # the same workload on a machine where the hybrid's own work is dear
    _, dear = plan_for(cfg, st, compute_costs=cm.ComputeCosts(vector_hybrid=1e3, ids_hybrid=1e3))
    assert all(ps.sharding_type != FREQUENCY_HYBRID for ps in dear.values())


def test_compute_prices_move_the_hot_set():
    cfg, st = _skewed()

    def hot_rows(costs):
        planner, _ = plan_for(cfg, st, compute_costs=costs, compare_plans=False)
        return planner._hybrid_enumerator.choices["big"]["row_wise"].hot_rows

    free = hot_rows(None)
    # every id is looked up once (hot ones against the replica, cold ones at their owner), and
    # owners also read their hot rows every step: dear lookups make hot rows dearer
    assert 0 < hot_rows(cm.ComputeCosts(lookup=200.0)) < free
    # a cold id is handled twice (routed here, received at its owner): dear id handling makes
    # cold ids dearer, so more rows are worth keeping hot
    assert free < hot_rows(cm.ComputeCosts(ids_hybrid=2000.0))


def test_bad_compute_costs_are_refused():
    cfg, st = _skewed()
    with pytest.raises(ValueError, match="compute_costs='fast'"):
        plan_for(cfg, st, compute_costs="fast")
    with pytest.raises(TypeError, match="compute_costs"):
        plan_for(cfg, st, compute_costs={"lookup": 1.0})


def test_cpu_defaults_are_the_committed_calibration():
    fitted = compute_costs.load_calibration(str(ROOT / "benchmarks" / "results" / "calibration.json"))
    cpu = compute_costs.default_compute_costs("cpu")
    assert cpu is not None and cpu.source == "benchmarks/results/calibration.json"
    for f in dataclasses.fields(cm.ComputeCosts):
        if f.name == "source":
            continue
        if getattr(fitted, f.name) is None:  # a term the committed fit predates (compute_costs.OPTIONAL_TERMS)
            assert getattr(cpu, f.name) is None, f.name
        else:  # the code keeps 4 significant digits
            assert getattr(cpu, f.name) == pytest.approx(getattr(fitted, f.name), rel=1e-3, abs=1e-9), f.name
    assert compute_costs.default_compute_costs("cuda") is None


def test_a_bad_calibration_file_names_itself(tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"fit": {"costs": {"lookup": 1.0}}}))
    with pytest.raises(ValueError, match="cal.json.*missing"):
        compute_costs.load_calibration(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a calibration file"):
        compute_costs.load_calibration(str(bad))
    assert compute_costs.default_compute_costs("cuda") is None
    # an infinite price (0 x inf = NaN for a plan without that work) or a true/false one is no price
    good = json.loads((ROOT / "benchmarks" / "results" / "calibration.json").read_text())
    for value in (float("inf"), True):
        doc = {**good, "fit": {**good["fit"], "costs": {**good["fit"]["costs"], "lookup": value}}}
        bad.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="cal.json: prices must be finite numbers >= 0.*'lookup'"):
            compute_costs.load_calibration(str(bad))


def test_a_fitted_collective_price_prices_the_plan_comparison():
    cfg, st = _skewed()
    costs = cm.ComputeCosts(lookup=1.0, vector_stock=1.0, vector_hybrid=1.0, collective_ms=5.0)
    fitted, _ = plan_for(cfg, st, compute_costs=costs)
    explicit, _ = plan_for(cfg, st, compute_costs=costs, collective_ms=0.2)  # the user's own price wins
    unfitted, _ = plan_for(cfg, st, compute_costs=dataclasses.replace(costs, collective_ms=None))
    for planner, price in ((fitted, 5.0), (explicit, 0.2), (unfitted, 0.2)):
        for c in planner.candidates:
            busiest = c.cost["bytes_ms"] + c.cost["compute_ms"]
            assert c.cost["cost_ms"] == pytest.approx(busiest + c.cost["collectives"] * price), (price, c.name)


def test_a_calibration_without_step_terms_loads_with_none(tmp_path):
    step_terms = ("collective_ms", "busiest_share")
    skip = ("source", "rms_ms", "rms_rel") + step_terms
    terms = {f.name: 1.0 for f in dataclasses.fields(cm.ComputeCosts) if f.name not in skip}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"fit": {"costs": terms}}))
    loaded = compute_costs.load_calibration(str(old))
    assert loaded.collective_ms is None and loaded.busiest_share is None
    old.write_text(json.dumps({"fit": {"costs": dict(terms, collective_ms=2.5, busiest_share=0.4)}}))
    loaded = compute_costs.load_calibration(str(old))
    assert loaded.collective_ms == 2.5 and loaded.busiest_share == 0.4
    old.write_text(json.dumps({"fit": {"costs": dict(terms, busiest_share=1.5)}}))
    with pytest.raises(ValueError, match="old.json: busiest_share .* got 1.5"):
        compute_costs.load_calibration(str(old))


def test_a_plan_sending_more_than_stock_on_its_busiest_rank_is_not_taken():
    from torchrec.distributed.planner import Topology

    from torchrec_hybrid.stats import FrequencyStats, criteo_table_sizes, criteo_tables
    from torchrec_hybrid.stats.synthetic import SyntheticCriteo

    # Criteo tables, DLRMv2 multi-hot bags, priced so that the partitioner places 26 table_wise
    # tables for compute: cheaper than TorchRec's placement of the same types, but its busiest
    # rank sends more
    sizes = criteo_table_sizes(max_rows=100_000)
    cfg = criteo_tables(sizes, embedding_dim=64)
    stats = FrequencyStats(cfg)
    for kjt in SyntheticCriteo(sizes, batch_size=2048, num_batches=2, alpha=1.1, multi_hot=True, seed=0):
        stats.update(kjt)
    costs = cm.ComputeCosts(lookup=1.172, vector_stock=6.813, vector_hybrid=6.238, ids_stock=1.967, ids_hybrid=40.0,
                            group_stock_ms=2.012, group_hybrid_ms=2.869)
    planner, _ = plan_for(cfg, stats, batch=512, compute_costs=costs, topology=Topology(world_size=4,
                                                                                        compute_device="cpu"))
    mixed, stock = (next(c for c in planner.candidates if c.name.startswith(p)) for p in ("hybrid planner", "stock"))
    assert mixed.cost["busiest_bytes"] > stock.cost["busiest_bytes"]  # the case: cheapest, but more bytes
    assert mixed.cost["cost_ms"] == min(c.cost["cost_ms"] for c in planner.candidates)
    assert max(planner.estimated_rank_bytes()) <= stock.cost["busiest_bytes"]
    assert planner.estimated_rank_bytes() != mixed.rank_bytes


def test_the_busiest_share_blends_the_busiest_and_the_mean_rank():
    ranks = torch.tensor([4.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    assert float(cm.ComputeCosts().step_ms(ranks)) == 4.0  # one rank per device: the busiest rank is the step
    assert float(cm.ComputeCosts(busiest_share=0.25).step_ms(ranks)) == pytest.approx(0.25 * 4.0 + 0.75 * 2.0)
    cfg, st = _skewed()
    costs = cm.ComputeCosts(lookup=1.0, vector_stock=1.0, vector_hybrid=1.0, busiest_share=0.0)
    planner, _ = plan_for(cfg, st, compute_costs=costs)
    assert isinstance(_compat.planner_perf_model(planner), StepPerfModel)  # proposals rated by the same step
    # busiest_share 0: the mean rank's cost, never more than the busiest rank's, less where ranks differ
    below = [c.cost["bytes_ms"] + c.cost["compute_ms"] - (c.cost["cost_ms"] - c.cost["collectives"] * 0.2)
             for c in planner.candidates]
    assert min(below) >= -1e-9 and max(below) > 0
    plain, _ = plan_for(cfg, st, compute_costs=dataclasses.replace(costs, busiest_share=None))
    assert not isinstance(_compat.planner_perf_model(plain), StepPerfModel)  # TorchRec's own


def test_the_step_perf_model_rates_the_blend_of_the_ranks_shard_perf():
    from torchrec.distributed.planner.types import Perf, Shard

    from torchrec_hybrid.planner import gloo_topology

    class Option:  # only what a perf model reads: shards with a rank and a perf
        def __init__(self, perfs):
            self.shards = [Shard(size=[1, 1], offset=[0, 0], rank=r,
                                 perf=Perf(fwd_compute=p, fwd_comms=0.0, bwd_compute=0.0, bwd_comms=0.0))
                           for r, p in perfs]

    plan = [Option([(0, 3.0), (1, 1.0)]), Option([(0, 1.0)]), Option([(3, 2.0)])]  # ranks: 4, 1, 0, 2
    topo = gloo_topology(4)
    assert StepPerfModel(topo, cm.ComputeCosts(busiest_share=1.0)).rate(plan) == pytest.approx(4.0)
    assert StepPerfModel(topo, cm.ComputeCosts(busiest_share=0.5)).rate(plan) == pytest.approx(0.5 * 4 + 0.5 * 7 / 4)


def test_plans_the_model_cannot_tell_apart_go_to_the_fewest_bytes():
    cfg, st = _skewed()
    dear = cm.ComputeCosts(vector_hybrid=50.0, ids_hybrid=50.0)
    strict, plan = plan_for(cfg, st, compute_costs=dear, tie_ms=0.0)
    assert plan["big"].sharding_type != FREQUENCY_HYBRID  # the case: hybrid is dearer than stock here
    cheapest = min(c.cost["cost_ms"] for c in strict.candidates)
    fewest = min(strict.candidates, key=lambda c: c.cost["busiest_bytes"])
    gap = fewest.cost["cost_ms"] - cheapest
    assert gap > 0 and strict.chosen.cost["cost_ms"] == cheapest
    # a tie band wider than the gap: the plan sending the fewest bytes on its busiest rank
    tied, plan = plan_for(cfg, st, compute_costs=dear, tie_ms=1.01 * gap)
    assert plan["big"].sharding_type == FREQUENCY_HYBRID
    assert tied.chosen.cost["busiest_bytes"] == fewest.cost["busiest_bytes"]
    # narrower than the gap: the model tells them apart and the cheapest stays
    apart, _ = plan_for(cfg, st, compute_costs=dear, tie_ms=0.99 * gap)
    assert apart.chosen.cost["cost_ms"] == cheapest
    # by default ("auto") no band, whatever the prices carry; "fit_error" takes the absolute error (rms_ms)
    default, _ = plan_for(cfg, st, compute_costs=dataclasses.replace(dear, rms_rel=1.01 * gap / cheapest))
    assert default.tie_ms == 0.0 and default.tie_rel == 0.0 and default.chosen.cost["cost_ms"] == cheapest
    with_error = dataclasses.replace(dear, rms_ms=1.01 * gap)
    plain, _ = plan_for(cfg, st, compute_costs=with_error)  # an absolute error alone: no band by default
    assert plain.tie_ms == 0.0 and plain.tie_rel == 0.0 and plain.chosen.cost["cost_ms"] == cheapest
    with pytest.raises(ValueError, match=r"compute_costs.rms_rel \(from none\) must be a finite share .* -1"):
        plan_for(cfg, st, compute_costs=dataclasses.replace(dear, rms_rel=-1.0))
    fitted, _ = plan_for(cfg, st, compute_costs=with_error, tie_ms="fit_error")
    assert fitted.tie_ms == pytest.approx(1.01 * gap) and fitted.chosen.rank_bytes == tied.chosen.rank_bytes
    with pytest.raises(ValueError, match="tie_ms='fit_error' needs compute prices .* got none"):
        plan_for(cfg, st, compute_costs=dear, tie_ms="fit_error")  # prices without a fit error
    with pytest.raises(ValueError, match="tie_ms must be a finite number of ms >= 0, got -1"):
        plan_for(cfg, st, compute_costs=dear, tie_ms=-1)
    with pytest.raises(ValueError, match=r"compute_costs.rms_ms \(from none\) must be a finite .* nan"):
        plan_for(cfg, st, compute_costs=dataclasses.replace(dear, rms_ms=float("nan")), tie_ms="fit_error")


def test_a_plan_must_beat_torchrecs_by_more_than_the_fit_can_tell():
    """stock_margin ("auto": the prices' relative error): another plan replaces TorchRec's only if it costs
    less by more than that share of TorchRec's cost, so a near-tie the fit cannot resolve never runs a plan
    slower than stock; prices without a relative error (bytes only, here) keep the cheapest."""
    cfg, st = _skewed()
    bytes_only = cm.ComputeCosts()
    base, plan = plan_for(cfg, st, compute_costs=bytes_only)
    assert plan["big"].sharding_type == FREQUENCY_HYBRID and base.stock_margin == 0.0
    stock = next(c for c in base.candidates if c.name.startswith("stock"))
    saving = 1 - base.chosen.cost["cost_ms"] / stock.cost["cost_ms"]
    assert saving > 0.05  # it pays for itself (min_saving)
    wide, plan = plan_for(cfg, st, compute_costs=dataclasses.replace(bytes_only, rms_rel=1.01 * saving))
    assert wide.stock_margin == pytest.approx(1.01 * saving) and wide.chosen.name.startswith("stock")
    assert plan["big"].sharding_type != FREQUENCY_HYBRID
    narrow, plan = plan_for(cfg, st, compute_costs=dataclasses.replace(bytes_only, rms_rel=0.99 * saving))
    assert narrow.chosen.rank_bytes == base.chosen.rank_bytes and plan["big"].sharding_type == FREQUENCY_HYBRID
    given, _ = plan_for(cfg, st, compute_costs=dataclasses.replace(bytes_only, rms_rel=0.99 * saving),
                        stock_margin=1.01 * saving)  # an explicit margin wins over the prices'
    assert given.chosen.name.startswith("stock")
    assert "TorchRec's plan wins unless another costs" in given.comparison_table()[0]
    for bad in (-0.1, 1.0, float("nan"), "wide"):
        with pytest.raises(ValueError, match="stock_margin must be 'auto' or a share"):
            plan_for(cfg, st, compute_costs=bytes_only, stock_margin=bad)


def test_a_calibration_carries_its_fit_error(tmp_path):
    skip = ("source", "rms_ms", "rms_rel")
    terms = {f.name: 1.0 for f in dataclasses.fields(cm.ComputeCosts) if f.name not in skip}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"fit": {"costs": terms, "rms_ms": 3.5, "rms_rel": 0.1}}))
    loaded = compute_costs.load_calibration(str(cal))
    assert loaded.rms_ms == 3.5 and loaded.rms_rel == 0.1
    cal.write_text(json.dumps({"fit": {"costs": terms, "rms_rel": -0.5}}))
    with pytest.raises(ValueError, match="cal.json: the fit's rms_rel must be a finite number >= 0, got -0.5"):
        compute_costs.load_calibration(str(cal))
    cal.write_text(json.dumps({"fit": {"costs": terms, "rms_ms": 3.5}}))
    assert compute_costs.load_calibration(str(cal)).rms_ms == 3.5
    cal.write_text(json.dumps({"fit": {"costs": terms}}))
    assert compute_costs.load_calibration(str(cal)).rms_ms is None
    cal.write_text(json.dumps({"fit": {"costs": terms, "rms_ms": "big"}}))
    with pytest.raises(ValueError, match="cal.json: the fit's rms_ms must be a finite number >= 0, got 'big'"):
        compute_costs.load_calibration(str(cal))
    cal.write_text(json.dumps({"fit": {"costs": terms, "rms_ms": float("inf")}}))
    with pytest.raises(ValueError, match="cal.json: the fit's rms_ms must be a finite number >= 0, got inf"):
        compute_costs.load_calibration(str(cal))


def _cand(name, cost_ms, busiest_bytes):
    from torchrec_hybrid.planner.planner import PlanCandidate

    return PlanCandidate(name, None, [], {"cost_ms": cost_ms, "busiest_bytes": busiest_bytes}, [])


def test_the_choice_rule_on_its_own():
    from torchrec_hybrid.planner.planner import choose_plan

    stock, mixed, hybrid = _cand("stock", 100, 100), _cand("mixed", 90, 99), _cand("hybrid", 96, 97)
    allowed = [stock, mixed, hybrid]
    assert choose_plan(allowed, stock, tie_ms=0, min_saving=0.05) is mixed  # the cheapest, saving 10%
    # hybrid is tied with mixed but saves under 5% of stock's cost and bytes: not a candidate,
    # so the tie goes to mixed, not back to stock
    assert choose_plan(allowed, stock, tie_ms=6, min_saving=0.05) is mixed
    # a plan saving bytes, not cost, pays for itself by its bytes and wins the tie
    frugal = _cand("frugal", 103, 50)
    assert choose_plan([stock, frugal], stock, tie_ms=5, min_saving=0.05) is frugal
    assert choose_plan([stock, frugal], stock, tie_ms=2, min_saving=0.05) is stock  # outside the band
    assert choose_plan([stock, _cand("near", 99, 97)], stock, tie_ms=5, min_saving=0.05) is stock  # saves too little
    # no stock plan to compare with: the cheapest, ties by bytes
    assert choose_plan([mixed, hybrid], None, tie_ms=0, min_saving=0.05) is mixed
    assert choose_plan([mixed, hybrid], None, tie_ms=6, min_saving=0.05) is hybrid


def test_the_comparison_says_whether_ties_go_to_the_fewest_bytes():
    """The logged comparison names the tie band it applied, or says there was none (not "within 0.00 ms")."""
    cfg, st = _skewed()
    dear = cm.ComputeCosts(vector_hybrid=50.0, ids_hybrid=50.0)
    strict, _ = plan_for(cfg, st, compute_costs=dear, tie_ms=0.0)
    assert "no tie band: the cheapest wins" in strict.comparison_table()[0]
    banded, _ = plan_for(cfg, st, compute_costs=dear, tie_ms=2.5)
    head = banded.comparison_table()[0]
    assert "ties within 2.50 ms go to the fewest bytes" in head and "no tie band" not in head


def test_virtual_features_cost_their_owner_the_measured_scalar_backward():
    """An owner that looks a one-hot, one-feature table up through virtual features (most of its
    cold rows: table-wise cold) leaves FBGEMM's vectorised CPU backward (row-wise AdaGrad); the
    model adds VIRTUAL_BACKWARD_EXTRA of that owner's lookups, nowhere else and in no other case."""
    from torchrec_hybrid.row_blocks import MULTI_HOT_POOLING
    virtual_owners = cm.HYBRID.virtual_owners

    t = dataclasses.replace(_traffic(1.0), features=1)
    W = t.world
    tw_bounds = [0, 0, t.rows, t.rows, t.rows]  # table-wise cold on rank 1
    virtual = virtual_owners(t, tw_bounds, scalar_virtual=True)
    assert virtual is not None and virtual.tolist() == [False, True, False, False]
    assert virtual_owners(t, [0, 12_500, 25_000, 37_500, 50_000], True) is None  # even row blocks: no owner heavy
    assert virtual_owners(t, tw_bounds, scalar_virtual=False) is None  # not CPU, or no vectorised path to leave
    assert virtual_owners(dataclasses.replace(t, pooling=MULTI_HOT_POOLING), tw_bounds, True) is None  # own TBE call
    assert virtual_owners(dataclasses.replace(t, features=2), tw_bounds, True) is None  # scalar either way
    shares = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    hot = torch.tensor([0.0, 300.0, 0.0, 0.0], dtype=torch.float64)
    plain = cm.HYBRID.rank_work(t, 0.6, shares, hot)
    priced = cm.HYBRID.rank_work(t, 0.6, shares, hot, virtual=virtual)
    lookup = cm.WORK_TERMS.index("lookup")
    owned = (0.4 * W * t.lookups + 300.0) * t.dim  # the owner's cold lookups and its hot rows
    extra = priced - plain
    assert extra[1, lookup] == pytest.approx(cm.VIRTUAL_BACKWARD_EXTRA * owned)
    extra[1, lookup] = 0.0
    assert extra.eq(0).all()


def test_the_virtual_backward_price_is_the_committed_measurement():
    """``cost_model.VIRTUAL_BACKWARD_EXTRA`` is what the tbe_paths study measured (its script left the tree)."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "tbe_paths.json").read_text())
    assert cm.VIRTUAL_BACKWARD_EXTRA == round(measured["extra_share"], 2)


def test_only_a_vectorised_cpu_backward_prices_virtual_features():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    vectorised_cpu_backward = cm.vectorised_cpu_backward

    assert vectorised_cpu_backward({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    assert not vectorised_cpu_backward({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "weight_decay": 0.01})
    assert not vectorised_cpu_backward({"optimizer": EmbOptimType.EXACT_SGD})
    assert not vectorised_cpu_backward(None)  # FBGEMM's default, EXACT_SGD


def test_cpu_prices_keep_one_hot_tables_off_virtual_features():
    """With the CPU prices and row-wise AdaGrad, a one-hot table's table-wise cold option costs its
    owner more than with SGD (whose CPU backward is scalar anyway); the byte model is the same."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder
    from torchrec_hybrid.planner import HybridEnumerator, gloo_topology

    cfg = tables({"t": 20_000}, dim=16)
    st = exact_stats(cfg, {"t": zipf_probs(20_000, 1.2)})
    perf = {}
    for opt in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD):
        enum = HybridEnumerator(gloo_topology(4), 256, frequency_stats=st, compute_costs=compute_costs.CPU_GLOO)
        sharder = HybridEmbeddingBagCollectionSharder(fused_params={"optimizer": opt, "learning_rate": 0.1})
        opts = enum.enumerate(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")), [sharder])
        perf[opt] = {o.hybrid_choice.cold_layout: o.total_perf for o in opts if o.sharding_type == FREQUENCY_HYBRID}
        choices = enum.choices["t"]
        perf[opt]["sizing virtual"] = {k: c.profile.virtual for k, c in choices.items()}
    rowwise, sgd = perf[EmbOptimType.EXACT_ROWWISE_ADAGRAD], perf[EmbOptimType.EXACT_SGD]
    assert rowwise["table_wise"] > sgd["table_wise"]
    assert rowwise["row_wise"] == pytest.approx(sgd["row_wise"])
    # the hot-set sizing prices the same owner the same way (row-wise blocks: sized as even ones)
    sized = rowwise["sizing virtual"]
    assert sized["table_wise"] is not None and sized["table_wise"].tolist() == [True, False, False, False]
    assert sized["row_wise"] is None and all(v is None for v in sgd["sizing virtual"].values())


def _table_wise_cold_perf(cfg, sharder, stats=None, constraints=None):
    """The table-wise cold option of the single table of ``cfg`` under the CPU prices."""
    from torchrec_hybrid.planner import HybridEnumerator, gloo_topology

    enum = HybridEnumerator(gloo_topology(4), 256, frequency_stats=stats, compute_costs=compute_costs.CPU_GLOO,
                            constraints=constraints)
    opts = enum.enumerate(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")), [sharder])
    return [o for o in opts if o.sharding_type == FREQUENCY_HYBRID and o.hybrid_choice.cold_layout == "table_wise"][0]


def test_a_table_of_two_features_is_never_priced_the_virtual_features_path():
    """Without per-feature statistics TorchRec gives a table one pooling factor, whatever its features;
    the feature count comes from the module's config: a table of two features takes FBGEMM's scalar
    backward in every layout, so no layout pays it extra."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.planner.types import ParameterConstraints

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    cfg = [torchrec.EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=20_000, feature_names=["a", "b"])]
    perf = {}
    for opt in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD):
        sharder = HybridEmbeddingBagCollectionSharder(hot_ids={"t": torch.arange(500)},
                                                      fused_params={"optimizer": opt, "learning_rate": 0.1})
        only_hybrid = {"t": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID])}  # no statistics: forced
        perf[opt] = _table_wise_cold_perf(cfg, sharder, constraints=only_hybrid).total_perf
    assert perf[EmbOptimType.EXACT_ROWWISE_ADAGRAD] == pytest.approx(perf[EmbOptimType.EXACT_SGD])


def test_the_planner_prices_its_candidates_with_the_sharders_optimizer():
    """The candidates' costs (plan_rank_cost) read the optimizer from the planner's sharders, as the
    enumerator's estimates read it from TorchRec's sharder data: the same extra on the same owner."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder

    cfg = tables({"t": 20_000}, dim=16)
    st = exact_stats(cfg, {"t": zipf_probs(20_000, 1.2)})
    lookup = cm.WORK_TERMS.index("lookup")
    work = {}
    tw = None
    for opt in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD):
        sharder = HybridEmbeddingBagCollectionSharder(fused_params={"optimizer": opt, "learning_rate": 0.1})
        planner, _ = plan_for(cfg, st, world=4, batch=256, sharder=sharder)
        traffic = planner.traffic_table()
        assert traffic is not None and set(traffic.vectorised.values()) == {opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD}
        if tw is None:  # one option (one hot set) priced under both planners' tables
            tw = _table_wise_cold_perf(cfg, sharder, st)
            for shard in tw.shards:
                shard.rank = 2
        work[opt] = cm.plan_rank_cost([tw], traffic, 4)[1][:, lookup]
    extra = work[EmbOptimType.EXACT_ROWWISE_ADAGRAD] - work[EmbOptimType.EXACT_SGD]
    assert extra[2] > 0 and extra[[0, 1, 3]].eq(0).all()
