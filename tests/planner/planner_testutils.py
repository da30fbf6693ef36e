"""Helpers for planner tests: tables, exact statistics from chosen row probabilities."""

from typing import Dict, List, Sequence

import torch
import torchrec
from torchrec.distributed.planner.stats import NoopEmbeddingStats

from torchrec_hybrid import HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.planner import HybridEmbeddingShardingPlanner, gloo_topology
from torchrec_hybrid.stats import FrequencyStats


def tables(sizes: Dict[str, int], dim: int = 64) -> List[torchrec.EmbeddingBagConfig]:
    return [torchrec.EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=r, feature_names=[f"f_{n}"])
            for n, r in sizes.items()]


def zipf_probs(rows: int, alpha: float) -> torch.Tensor:
    w = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    return w / w.sum()


def mixture_probs(rows: int, skew: float, pool: int = 2000, alpha: float = 1.0) -> torch.Tensor:
    """``skew`` of the lookups Zipf(alpha) over the first ``pool`` rows, the rest uniform."""
    p = torch.full((rows,), (1 - skew) / rows, dtype=torch.float64)
    p[:pool] += skew * zipf_probs(pool, alpha)
    return p


def exact_stats(configs: Sequence[torchrec.EmbeddingBagConfig], probs: Dict[str, torch.Tensor],
                samples: int = 1 << 16, seed: int = 0, sorted_ids: bool = False) -> FrequencyStats:
    """FrequencyStats whose counts are round(p * samples) (one-hot, ids scattered by a permutation,
    or ``sorted_ids``: id = popularity rank)."""
    g = torch.Generator().manual_seed(seed)
    st = FrequencyStats(configs)
    values = []
    for c in configs:
        p = probs.get(c.name, torch.full((c.num_embeddings,), 1.0 / c.num_embeddings, dtype=torch.float64))
        counts = torch.floor(p * samples).to(torch.int64)
        counts[: samples - int(counts.sum())] += 1  # top up the most likely rows
        perm = torch.arange(c.num_embeddings) if sorted_ids else torch.randperm(c.num_embeddings, generator=g)
        values.append(perm[torch.repeat_interleave(torch.arange(c.num_embeddings), counts)])
    keys = [f for c in configs for f in c.feature_names]
    kjt = torchrec.KeyedJaggedTensor(keys=keys, values=torch.cat(values),
                                     lengths=torch.ones(samples * len(keys), dtype=torch.int32), stride=samples)
    st.update(kjt)
    return st


def plan_for(configs, stats=None, world: int = 4, batch: int = 1024, constraints=None, sharder=None, **kw):
    ebc = torchrec.EmbeddingBagCollection(tables=list(configs), device=torch.device("meta"))
    planner = HybridEmbeddingShardingPlanner(topology=kw.pop("topology", gloo_topology(world)), batch_size=batch,
                                             frequency_stats=stats, constraints=constraints,
                                             stats=[NoopEmbeddingStats()], **kw)
    plan = planner.plan(ebc, [sharder or HybridEmbeddingBagCollectionSharder()])
    return planner, plan.plan[""]
