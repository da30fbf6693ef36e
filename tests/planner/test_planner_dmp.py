"""A planner-made mixed plan (forced hybrid + stock types) runs under DMP on 2 gloo ranks."""

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.stats import NoopEmbeddingStats

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
    keys = [c.feature_names[0] for c in cfg]
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        values = torch.cat([torch.randint(0, c.num_embeddings, (8,), generator=g) for c in cfg])
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values,
                                                           lengths=torch.ones(8 * len(keys), dtype=torch.int32))
        out = model(kjt).wait()
        assert out.values().shape == (8, 16 * len(cfg)) and torch.isfinite(out.values()).all()
        out.values().square().sum().backward()
    return ps["hyb"].hot_ids.numel()


def test_planner_plan_runs_under_dmp_on_two_ranks():
    hot = run_ranks(_mixed_plan_trains, 2, timeout=240)
    assert hot[0] == hot[1] > 0
