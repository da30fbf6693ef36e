"""The data of one workload on one rank: hot set from statistics, then the measured batches.

Every rank draws the same *global* batches (``W * B`` samples) from the project's
`SyntheticCriteo` generator with one seed, and keeps its own slice, so all ranks agree on
the table permutations, statistics and hot set without any communication, and every
sharding type sees exactly the same ids. The hot set comes from `FrequencyStats` over
``stats_batches`` global batches drawn *before* the measured ones (not the measured data).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.stats import FrequencyStats, SyntheticCriteo, criteo_table_sizes, criteo_tables, select_hot_ids

from benchmarks.config import Workload

DENSE_FEATURES = 13


@dataclass
class Batch:
    """One rank's share of a step: sparse ids, and dense features + labels for DLRM."""

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor


@dataclass
class WorkloadData:
    tables: list                      # EmbeddingBagConfig per feature
    hotness: List[int]                # ids per sample, per feature
    stats: FrequencyStats
    hot_ids: Dict[str, torch.Tensor]  # global top `hot_rows` rows across all tables
    batches: List[Batch]              # warm-up + timed steps (this rank's slice)

    def cold_fraction(self) -> Dict[str, float]:
        """Per table: share of lookups (in the statistics) that miss the hot set."""
        out = {}
        for t in self.tables:
            total = self.stats.lookups(t.name)
            hot = int(self.stats.counts(t.name)[self.hot_ids[t.name]].sum()) if total else 0
            out[t.name] = 1.0 - hot / total if total else 0.0
        return out


def rank_slice(kjt: KeyedJaggedTensor, hotness: List[int], rank: int, local: int) -> KeyedJaggedTensor:
    """Samples ``[rank*local, (rank+1)*local)`` of a fixed-hotness global KJT (loop over features)."""
    values, parts, off = kjt.values(), [], 0
    glob = kjt.stride()
    for h in hotness:
        parts.append(values[off + rank * local * h: off + (rank + 1) * local * h])
        off += glob * h
    lengths = torch.cat([torch.full((local,), h, dtype=torch.int32) for h in hotness])
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(parts), lengths=lengths, stride=local)


def make_data(w: Workload, rank: int, world: Optional[int] = None, batches: Optional[int] = None) -> WorkloadData:
    """Statistics, hot ids and this rank's batches for workload `w` (identical on all ranks)."""
    world = world or w.world
    sizes = criteo_table_sizes(max_rows=w.rows_cap)
    tables = criteo_tables(sizes, embedding_dim=w.dim)
    n = batches if batches is not None else w.warmup + w.steps
    gen = SyntheticCriteo(sizes, batch_size=w.batch_per_rank * world, num_batches=w.stats_batches + n,
                          alpha=w.alpha, multi_hot=w.multi_hot, seed=w.seed)
    stats = FrequencyStats(tables)
    g = torch.Generator().manual_seed(w.seed + 1000 + rank)
    out: List[Batch] = []
    for i, kjt in enumerate(gen):
        if i < w.stats_batches:
            stats.update(kjt)
            continue
        out.append(Batch(rank_slice(kjt, gen.hotness, rank, w.batch_per_rank),
                         torch.rand(w.batch_per_rank, DENSE_FEATURES, generator=g),
                         torch.randint(0, 2, (w.batch_per_rank,), generator=g).float()))
    hot = select_hot_ids(stats, memory_budget_bytes=w.hot_rows * w.dim * 4, bytes_per_row=lambda c: c.embedding_dim * 4)
    return WorkloadData(tables, list(gen.hotness), stats, hot, out)
