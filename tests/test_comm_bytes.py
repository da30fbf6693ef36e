"""Bytes really sent per training step: the hybrid sends less than table_wise on skewed ids,
and less still as the hot set grows (counted by the kernel, /proc/self/io).

"Grows" within reason: the hot rows are synchronised densely every step, so past the point
where a row's sync costs more than its cold lookups would, more hot rows send more bytes;
choosing that point is the planner's job (torchrec_hybrid.planner).
"""

import torch
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from tests.models import OPTIMIZERS, build
from tests.multiprocess import run_ranks
from torchrec_hybrid import HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.comm_bytes import count_sent_bytes

ROWS, DIM, BATCH, ALPHA = 2000, 32, 1024, 1.2


def _zipf_batch(configs, seed):
    """One id per feature, Zipf(ALPHA) over a fixed permutation of each table's rows."""
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, ROWS + 1, dtype=torch.float64) ** -ALPHA
    ranks = torch.multinomial(p, BATCH * len(configs), replacement=True, generator=g).view(len(configs), BATCH)
    perms = torch.stack([torch.randperm(ROWS, generator=torch.Generator().manual_seed(i)) for i in range(len(configs))])
    values = torch.gather(perms, 1, ranks).reshape(-1)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=[c.feature_names[0] for c in configs], values=values, lengths=torch.ones_like(values))


def _hot(configs, k):
    return {c.name: torch.randperm(ROWS, generator=torch.Generator().manual_seed(i))[:k] for i, c in enumerate(configs)}


def step_bytes(rank, world):
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS,
                                           feature_names=[f"f{i}"]) for i in range(4)]
    models = {
        "table_wise": build(configs, world, {}, EmbeddingBagCollectionSharder(fused_params=OPTIMIZERS["sgd"])),
        "hybrid_5": build(configs, world, {c.name: "hybrid" for c in configs},
                           HybridEmbeddingBagCollectionSharder(_hot(configs, 5), fused_params=OPTIMIZERS["sgd"])),
        "hybrid_50": build(configs, world, {c.name: "hybrid" for c in configs},
                            HybridEmbeddingBagCollectionSharder(_hot(configs, 40), fused_params=OPTIMIZERS["sgd"])),
    }
    sent = {}
    for step in range(2):  # step 0 warms up; step 1 is counted
        kjt = _zipf_batch(configs, seed=10 * step + rank)
        for name, model in models.items():
            with count_sent_bytes() as n:
                model(kjt).wait().values().sum().backward()
            sent[name] = n[0]
    return sent


def test_hybrid_sends_less_and_less_with_more_hot_rows():
    per_rank = run_ranks(step_bytes, 2)
    total = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
    assert total["table_wise"] > 0
    assert total["hybrid_5"] < total["table_wise"], total
    assert total["hybrid_50"] < total["hybrid_5"], total
