"""Five-minute tour: count ids, plan with frequency_hybrid, shard with DMP, train a few steps.

    .venv/bin/torchrun --nproc_per_node 2 examples/quickstart.py

Runs on CPU/gloo (NCCL when CUDA is present). Rank 0 prints the planner's comparison of its
candidate plans (TorchRec's, the mixed one, the all-hybrid one; ``*`` marks the one returned)
and one JSON line: the hybrid tables, the loss of the last step and the bytes it sent.
"""

import gc
import json
import logging
import os

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel

from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, HybridEmbeddingShardingPlanner
from torchrec_hybrid.comm_bytes import count_sent_bytes
from torchrec_hybrid.planner.topology import gloo_topology
from torchrec_hybrid.stats import FrequencyStats, SyntheticCriteo, criteo_table_sizes, criteo_tables


def plan_and_train(rank: int, world: int, device: torch.device) -> None:
    cuda = device.type == "cuda"

    # 1. 26 Criteo-like tables (capped at 20k rows) and skewed synthetic batches.
    sizes = criteo_table_sizes(max_rows=20_000)
    tables = criteo_tables(sizes, embedding_dim=32)  # EmbeddingBagConfig "t_cat_i" per feature "cat_i"
    data = SyntheticCriteo(sizes, batch_size=512, num_batches=8, alpha=1.1, seed=rank)

    # 2. Frequency statistics from the first batches, merged across ranks.
    stats = FrequencyStats(tables)
    for kjt in data:
        stats.update(kjt)
    stats.all_reduce_()

    # 3. Plan: the planner prices frequency_hybrid next to the stock types and sizes hot sets.
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = HybridEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8})
    topology = gloo_topology(world) if not cuda else None
    # compute_costs=None prices bytes and collectives only, as for a network-bound GPU cluster
    # (CUDA's default). Left out on CPU, the planner also prices this machine's compute
    # (planner/compute_costs.py) and, on 2 CPU cores with a loopback network, keeps stock types.
    planner = HybridEmbeddingShardingPlanner(topology=topology, batch_size=512, frequency_stats=stats,
                                             compute_costs=None)
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    hybrid = [t for t, ps in plan.plan[""].items() if ps.sharding_type == "frequency_hybrid"]

    # 4. Shard and train: a drop-in for DistributedModelParallel.
    model = DistributedModelParallel(ebc, device=device, plan=plan, sharders=[sharder])
    for step, kjt in enumerate(data):
        with count_sent_bytes() as sent:
            pooled = model(kjt.to(device)).wait().values()
            loss = (pooled.float() ** 2).mean()
            loss.backward()  # the fused optimizer updates hot and cold rows here
    if rank == 0:
        print("\n".join(planner.comparison_table()))
        print(json.dumps({"hybrid_tables": hybrid, "tables": len(tables), "last_loss": loss.item(),
                          "bytes_sent_last_step": sent[0]}))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    logging.basicConfig(level=logging.WARNING)
    plan_and_train(dist.get_rank(), dist.get_world_size(), device)
    dist.destroy_process_group()
    # The model holds the process group, and Gloo's worker threads live as long as it does: one
    # still releasing a finished all-to-all while the interpreter shuts down aborts the process.
    # Collecting the model now joins them before exit.
    gc.collect()


if __name__ == "__main__":
    main()
