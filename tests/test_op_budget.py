"""The hot path's op budget: a training step of an all-hybrid plan dispatches at most 1.5x the ops of
the same EBC sharded table_wise, with no more collectives and host syncs.

Counted with ``benchmarks.step_counts`` (a ``TorchDispatchMode`` around one forward and one backward,
every op the dispatcher runs, ours, TorchRec's and FBGEMM's alike) on the product benchmark's 26
Criteo-Kaggle tables (capped small), one-hot and DLRMv2 multi-hot bags, 2 gloo ranks, every rank's
count. On a GPU every op is a kernel launch and every host sync a stall, whatever the bytes; the
fused CPU ops (sharding/fused.py) are what keeps the hybrid's count at table_wise's.
"""

import pytest
import torch

from tests.multiprocess import run_ranks

BUDGET = 1.5


def _counts(rank, world, multi_hot):
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from benchmarks.data import rank_slice
    from benchmarks.workloads import fused_params
    from benchmarks.step_counts import count_training_step
    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, HybridEmbeddingShardingPlanner
    from torchrec_hybrid.stats import FrequencyStats, criteo_table_sizes, criteo_tables
    from torchrec_hybrid.stats.synthetic import SyntheticCriteo

    sizes = criteo_table_sizes(max_rows=2000)
    tables = criteo_tables(sizes, embedding_dim=16)
    batch = 64
    gen = SyntheticCriteo(sizes, batch_size=batch * world, num_batches=5, alpha=1.1, multi_hot=multi_hot, seed=0)
    stats, batches = FrequencyStats(tables), []
    for i, kjt in enumerate(gen):
        if i < 2:
            stats.update(kjt)
        else:
            batches.append(rank_slice(kjt, gen.hotness, rank, batch))
    topo = Topology(world_size=world, compute_device="cpu")

    def ebc():
        return torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

    def constrained(kind):
        return {t.name: ParameterConstraints(sharding_types=[kind]) for t in tables}

    hybrid_sharder = HybridEmbeddingBagCollectionSharder(fused_params=fused_params())
    stock_sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    pg = dist.GroupMember.WORLD
    hybrid_plan = HybridEmbeddingShardingPlanner(
        topology=topo, batch_size=batch, frequency_stats=stats, compute_costs=None, compare_plans=False,
        constraints=constrained("frequency_hybrid")).collective_plan(ebc(), [hybrid_sharder], pg)
    stock_plan = EmbeddingShardingPlanner(topology=topo, batch_size=batch, constraints=constrained(
        "table_wise")).collective_plan(ebc(), [stock_sharder], pg)
    models = {"hybrid": DistributedModelParallel(ebc(), device=torch.device("cpu"), plan=hybrid_plan,
                                                 sharders=[hybrid_sharder]),
              "table_wise": DistributedModelParallel(ebc(), device=torch.device("cpu"), plan=stock_plan,
                                                     sharders=[stock_sharder])}
    types = {ps.sharding_type for ps in hybrid_plan.plan[""].values()}
    out = {"types": sorted(types)}
    for name, model in models.items():
        for b in batches[:2]:  # past the first exchange (rooms of 0: a second all-to-all) and lazy set-up
            model(b).wait().values().sum().backward()
        out[name] = count_training_step(model, batches[2])
    return out


@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
def test_hybrid_step_dispatches_at_most_1_5x_table_wise_ops(multi_hot):
    per_rank = run_ranks(_counts, 2, multi_hot=multi_hot)
    for rank, c in enumerate(per_rank):
        assert c["types"] == ["frequency_hybrid"], c["types"]
        h, t = c["hybrid"], c["table_wise"]
        ops_h, ops_t = h["fwd_ops"] + h["bwd_ops"], t["fwd_ops"] + t["bwd_ops"]
        assert ops_h <= BUDGET * ops_t, (rank, ops_h, ops_t, h, t)
        for what in ("collectives", "host_syncs"):
            assert h[f"fwd_{what}"] + h[f"bwd_{what}"] <= t[f"fwd_{what}"] + t[f"bwd_{what}"], (rank, what, h, t)
