"""`check_hot_ids`: hot ids naming no table are an error, ones for tables the plan does not make
frequency_hybrid one warning listing them (issue 20, item 5)."""

import warnings

import pytest
import torch
import torchrec
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan

from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, frequency_hybrid
from torchrec_hybrid.sharding_plan import check_hot_ids, embedding_table_names, planned_sharding_types
from torchrec_hybrid.types import HotSetError

WORLD = 2


def _configs(prefix=""):
    return [torchrec.EmbeddingBagConfig(name=f"{prefix}t{i}", embedding_dim=8, num_embeddings=20 + i,
                                        feature_names=[f"{prefix}f{i}"]) for i in range(3)]


def _module_plan(ebc, hybrid=("t0",)):
    gens = {c.name: frequency_hybrid() if c.name in hybrid else table_wise(rank=0, compute_kernel="fused")
            for c in ebc.embedding_bag_configs()}
    return construct_module_sharding_plan(ebc, gens, sharder=HybridEmbeddingBagCollectionSharder(),
                                          local_size=WORLD, world_size=WORLD, device_type="cpu")


@pytest.fixture
def ebc():
    return torchrec.EmbeddingBagCollection(tables=_configs(), device=torch.device("meta"))


def _ids(*names):
    return {n: torch.tensor([0, 1]) for n in names}


def test_hybrid_tables_pass_silently(ebc):
    plan = _module_plan(ebc, hybrid=("t0", "t1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_hot_ids(_ids("t0", "t1"), plan) == []
        assert check_hot_ids({}, plan) == [] and check_hot_ids(None, plan) == []


def test_unknown_tables_are_an_error_naming_them(ebc):
    plan = _module_plan(ebc)
    with pytest.raises(HotSetError, match=r"do not exist: \['nope', 'T0'\]; the tables are \['t0', 't1', 't2'\]"):
        check_hot_ids(_ids("t0", "nope", "T0"), plan)
    with pytest.raises(ValueError, match="nope"):  # HotSetError is a ValueError
        check_hot_ids(_ids("nope"), None, tables=embedding_table_names(ebc))


def test_non_hybrid_tables_give_one_warning_listing_them(ebc):
    plan = _module_plan(ebc, hybrid=("t0",))
    with pytest.warns(UserWarning) as record:
        ignored = check_hot_ids(_ids("t0", "t1", "t2"), plan)
    assert ignored == ["t1", "t2"] and len(record) == 1
    msg = str(record[0].message)
    assert "['t1', 't2']" in msg and "t1: table_wise" in msg and "frequency_hybrid" in msg


def test_whole_model_plan_with_two_collections():
    """A ShardingPlan over two EBCs: names are checked against every module's tables."""
    model = torch.nn.Module()
    model.a = torchrec.EmbeddingBagCollection(tables=_configs("a_"), device=torch.device("meta"))
    model.b = torchrec.EmbeddingBagCollection(tables=_configs("b_"), device=torch.device("meta"))
    plan = ShardingPlan({"a": _module_plan(model.a, hybrid=("a_t0",)), "b": _module_plan(model.b, hybrid=("b_t2",))})
    assert planned_sharding_types(plan)["b_t2"] == "frequency_hybrid"
    assert embedding_table_names(model) == [f"{p}t{i}" for p in ("a_", "b_") for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_hot_ids(_ids("a_t0", "b_t2"), plan, tables=embedding_table_names(model))
    with pytest.warns(UserWarning, match=r"\['b_t1'\]"):
        check_hot_ids(_ids("a_t0", "b_t1"), plan, tables=embedding_table_names(model))
    with pytest.raises(HotSetError, match=r"\['c_t0'\]"):
        check_hot_ids(_ids("c_t0"), plan, tables=embedding_table_names(model))
    # a table of the model missing from the plan (an unsharded module) counts as not hybrid
    with pytest.warns(UserWarning, match="c_t0: not in the plan"):
        check_hot_ids(_ids("c_t0"), plan, tables=embedding_table_names(model) + ["c_t0"])


def test_the_planner_refuses_hot_ids_of_unknown_tables_and_warns_once_for_unplanned_ones():
    from torchrec.distributed.planner import ParameterConstraints

    from tests.planner.planner_testutils import exact_stats, plan_for, tables, zipf_probs

    cfg = tables({"small": 2000, "big": 100_000})
    st = exact_stats(cfg, {"big": zipf_probs(100_000, 1.1)})
    with pytest.raises(HotSetError, match="nosuch"):
        plan_for(cfg, st, sharder=HybridEmbeddingBagCollectionSharder(hot_ids={"nosuch": torch.arange(3)}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, plan = plan_for(cfg, st, constraints={"small": ParameterConstraints(sharding_types=["table_wise"])},
                           sharder=HybridEmbeddingBagCollectionSharder(hot_ids={"small": torch.arange(3)}))
    assert plan["small"].sharding_type == "table_wise"
    assert len([w for w in caught if "small" in str(w.message)]) == 1


def test_an_empty_list_is_no_hot_row():
    """``[]`` (which torch.as_tensor makes float32) is an empty hot set, like ``torch.empty(0, int64)``."""
    from torchrec_hybrid.types import normalize_hot_ids

    got = normalize_hot_ids({"t0": [], "t1": [3, 1]}, _configs())
    assert got["t0"].dtype == torch.int64 and got["t0"].numel() == 0 and got["t1"].tolist() == [1, 3]
