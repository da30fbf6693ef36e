"""One version of a sharding's hot set, carried by each step's input from input dist to output dist.

A hot set is only a choice of which rows every rank looks up locally: every row lives in its
owner's cold shard whatever the choice, so changing it moves no weights and no optimizer
state (hot_replica.py). What changes is derived data: the hot ids' slots, the replicas'
layout and which owner sends which row (the input dist rebuilds its key maps from them).
:class:`HotState` bundles that for one version. The input dist stamps each step's input
with the state it split the ids by, and the lookup and output dist read it from there, so
a refresh between two steps never mixes two hot sets - not even for a batch already in
flight under ``TrainPipelineSparseDist``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig

from torchrec_hybrid.sharding.hot_replica import HotPooling, HotRowLayout


@dataclass(eq=False)
class HotState:
    """The hot set of one sharding, one version.

    version: 0 for the planned set, +1 per refresh (the same on every rank).
    hot_ids: sorted hot ids per table (sharding order).
    slot_starts: per table, the slot of its first hot id (its ids take consecutive slots).
    replicas / layout: the groups' replicas and where every hot slot lives (hot_replica.py).
    feature_shift: per feature (sharding order), the slot of row 0 of its replica table.
    """

    version: int
    hot_ids: List[torch.Tensor]
    slot_starts: List[int]
    replicas: List[HotPooling]
    layout: HotRowLayout
    feature_shift: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    def pool(self, replica: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor],
             batch: int) -> torch.Tensor:
        """Pooled hot embeddings ``[batch, sum of the groups' widths]`` of this rank's hot lookups (``rows``
        jagged by (feature, sample) through ``offsets``, input_dist.py) from the flat ``replica`` (the owners'
        rows as the output dist assembled them): one dense TBE call per group (hot_replica.HotPooling)."""
        if len(self.replicas) == 1:
            return self.replicas[0].pool(replica, rows, offsets, weights, batch)
        out, f0 = [], 0
        for rep, base in zip(self.replicas, self.layout.flat_bases):  # per group (set-up sized loop)
            nf = rep.num_features  # the group's offsets index into every group's lookups
            out.append(rep.pool(replica[base:base + rep.flat_size], rows, offsets[f0 * batch:(f0 + nf) * batch + 1],
                                weights, batch))
            f0 += nf
        return torch.cat(out, dim=1)


def build_hot_state(groups: Sequence[GroupedEmbeddingConfig], hot_ids_per_group: Sequence[Sequence[torch.Tensor]],
                    bounds_per_group: Sequence[Sequence[Sequence[int]]], world: int, rank: int, device: torch.device,
                    version: int = 0) -> HotState:
    """The state of ``hot_ids_per_group`` (per group, per table: sorted ids) for row blocks
    ``bounds_per_group``. Hot slots are numbered group after group, each group's as its
    replica stores them. Set-up / refresh time: loops over groups and tables."""
    replicas: List[HotPooling] = []
    base = 0
    for g, ids in zip(groups, hot_ids_per_group):
        replicas.append(HotPooling(g, list(ids), device, slot_base=base))
        base += replicas[-1].num_slots
    bounds = [[list(b) for b in g] for g in bounds_per_group]
    layout = HotRowLayout(replicas, bounds, [list(i) for i in hot_ids_per_group], world, rank).to(device)
    return HotState(
        version=version,
        hot_ids=[h for ids in hot_ids_per_group for h in ids],
        slot_starts=[r.slot_base + s for r in replicas for s in r.table_slot_start],
        replicas=replicas,
        layout=layout,
        feature_shift=torch.cat([r.feature_shift for r in replicas]).to(device),
    )
