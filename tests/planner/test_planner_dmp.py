"""A planner-made mixed plan (forced hybrid + stock types) runs under DMP on 2 gloo ranks."""

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.stats import NoopEmbeddingStats

from tests.models import full_weight
from tests.multiprocess import run_ranks
from tests.planner.planner_testutils import exact_stats, tables, zipf_probs


def _mixed_plan_trains(rank, world):
    from torchrec_hybrid import FREQUENCY_HYBRID, HybridEmbeddingBagCollectionSharder
    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, HybridParameterSharding, gloo_topology

    cfg = tables({"hyb": 2000, "tw": 300, "cw": 400, "dp": 10}, dim=16)
    st = exact_stats(cfg, {"hyb": zipf_probs(2000, 1.2)}, samples=4096)
    cons = {"hyb": ParameterConstraints(sharding_types=[FREQUENCY_HYBRID]),
            "tw": ParameterConstraints(sharding_types=["table_wise"]),
            "cw": ParameterConstraints(sharding_types=["column_wise"]),
            "dp": ParameterConstraints(sharding_types=["data_parallel"])}
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(world), batch_size=8, constraints=cons,
                                             frequency_stats=st, stats=[NoopEmbeddingStats()])
    sharder = HybridEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    meta = torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta"))
    plan = planner.collective_plan(meta, [sharder], dist.GroupMember.WORLD)
    ps = plan.plan[""]
    assert {k: v.sharding_type for k, v in ps.items()} == {
        "hyb": FREQUENCY_HYBRID, "tw": "table_wise", "cw": "column_wise", "dp": "data_parallel"}
    assert isinstance(ps["hyb"], HybridParameterSharding) and ps["hyb"].hot_ids.numel() > 0
    model = DistributedModelParallel(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
                                     device=torch.device("cpu"), plan=plan, sharders=[sharder])
    assert torch.equal(model.module.hot_ids()["hyb"], ps["hyb"].hot_ids)
    # the reference: the same plan with the hybrid table table_wise, stock sharder, same init
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, data_parallel,
                                                    table_wise)
    from torchrec.distributed.types import ShardingPlan

    stock_sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                "learning_rate": 0.1})
    meta = torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta"))
    stock_plan = construct_module_sharding_plan(
        meta, {"hyb": table_wise(rank=0, compute_kernel="fused"),  # the plan's kernels: fused SGD in backward
               "tw": table_wise(rank=ps["tw"].ranks[0], compute_kernel="fused"),
               "cw": column_wise(ranks=ps["cw"].ranks, compute_kernel="fused"), "dp": data_parallel()},
        sharder=stock_sharder, local_size=world, world_size=world, device_type="cpu")
    stock = DistributedModelParallel(meta, device=torch.device("cpu"), plan=ShardingPlan({"": stock_plan}),
                                     sharders=[stock_sharder])
    torch.manual_seed(0)
    init = torchrec.EmbeddingBagCollection(tables=cfg).state_dict()
    model.load_state_dict(init)
    stock.load_state_dict(init)
    keys = [c.feature_names[0] for c in cfg]
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        values = torch.cat([torch.randint(0, c.num_embeddings, (8,), generator=g) for c in cfg])
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values,
                                                           lengths=torch.ones(8 * len(keys), dtype=torch.int32))
        # by key: the two modules may lay their output's columns out in different orders
        got, want = model(kjt).wait().to_dict(), stock(kjt).wait().to_dict()
        out, ref = (torch.cat([d[k] for k in keys], 1) for d in (got, want))
        assert out.shape == (8, 16 * len(cfg))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        out.square().sum().backward()
        ref.square().sum().backward()
    for k, v in stock.state_dict().items():  # trained alike: every table's weights
        torch.testing.assert_close(full_weight(model.state_dict()[k]), full_weight(v), atol=1e-5, rtol=1e-5)
    return ps["hyb"].hot_ids.numel()


def test_planner_plan_trains_under_dmp_like_stock_on_two_ranks():
    hot = run_ranks(_mixed_plan_trains, 2, timeout=240)
    assert hot[0] == hot[1] > 0


def _column_wise_cold_plan_trains(rank, world):
    """The planner cuts one hot multi-hot table in column slices (one per rank); the plan runs
    under DMP and trains like stock column_wise on the same slices (SGD, 3 steps)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder
    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology

    cfg = tables({"big": 20_000}, dim=64)
    st = exact_stats(cfg, {"big": zipf_probs(20_000, 1.1)}, samples=4096)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    planner = HybridEmbeddingShardingPlanner(
        topology=gloo_topology(world), batch_size=512, frequency_stats=st, stats=[NoopEmbeddingStats()],
        constraints={"big": ParameterConstraints(pooling_factors=[5.0])}, compute_costs=None)
    sharder = HybridEmbeddingBagCollectionSharder(fused_params=dict(fused))
    plan = planner.collective_plan(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
                                   [sharder], dist.GroupMember.WORLD)
    ps = plan.plan[""]["big"]
    assert ps.cold_layout == "column_wise", ps
    assert sorted(str(s.placement) for s in ps.sharding_spec.shards) == [f"rank:{r}/cpu" for r in range(world)]
    stock_ps = ParameterSharding(sharding_type="column_wise", compute_kernel="fused", ranks=ps.ranks,
                                 sharding_spec=ps.sharding_spec)
    torch.manual_seed(0)
    ref = torchrec.EmbeddingBagCollection(tables=cfg)
    models = []
    for p, s in ((plan, sharder), (ShardingPlan({"": {"big": stock_ps}}),
                                   EmbeddingBagCollectionSharder(fused_params=dict(fused)))):
        m = DistributedModelParallel(torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta")),
                                     device=torch.device("cpu"), plan=p, sharders=[s])
        m.load_state_dict(ref.state_dict())
        models.append(m)
    g = torch.Generator().manual_seed(rank)
    probs = zipf_probs(20_000, 1.1)
    for step in range(3):
        lengths = torch.randint(0, 30, (16,), generator=g)
        values = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=cfg[0].feature_names, values=values, lengths=lengths)
        outs = [m(kjt).wait().values() for m in models]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        for o in outs:
            (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
    return ps.hot_ids.numel()


def test_planner_column_wise_cold_plan_trains_like_column_wise():
    hot = run_ranks(_column_wise_cold_plan_trains, 2, timeout=240)
    assert hot[0] == hot[1] > 0


def _plan_on_ranks_1_and_2(rank, world):
    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder
    from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology

    pg = dist.new_group([1, 2])  # every rank creates it; rank 0 is not in it
    if rank == 0:
        return None
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(2), batch_size=64, compute_costs=None,
                                             stats=[NoopEmbeddingStats()])
    ebc = torchrec.EmbeddingBagCollection(tables=tables({"t": 1000, "u": 50}), device=torch.device("meta"))
    plan = planner.collective_plan(ebc, [HybridEmbeddingBagCollectionSharder()], pg)
    return {name: (ps.sharding_type, ps.ranks) for name, ps in plan.plan[""].items()}


def test_collective_plan_on_a_group_without_global_rank_0():
    """The group's first rank plans and broadcasts (it used to name global rank 0, not in the group)."""
    plans = run_ranks(_plan_on_ranks_1_and_2, 3, timeout=120)
    assert plans[0] is None and plans[1] == plans[2] and set(plans[1]) == {"t", "u"}
