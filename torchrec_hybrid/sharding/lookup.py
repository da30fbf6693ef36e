"""Lookup of the frequency-hybrid sharding: the owner's cold lookups, in lanes.

The cold part is TorchRec's own ``GroupedPooledEmbeddingsLookup`` over the row-wise shard
(fused TBEs, fused optimizer, state_dict all stock), one TBE call per lane (cells.LaneLayout):
its input, unpacked by the input dist, holds the received bags and the hot rows this rank owns,
as one-id bags, so they can be sent to every replica and be updated by the fused optimizer in
backward. The output keeps the lanes' outputs unreduced; the output dist routes the cold partial
sums and the hot rows, pools the local hot lookups from the replica and adds the sums up.
"""

import dataclasses
from typing import List, NamedTuple, Optional, Set, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import BaseEmbeddingLookup, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType

from torchrec_hybrid import _compat
from torchrec_hybrid.row_blocks import MULTI_HOT_POOLING
from torchrec_hybrid.sharding.cells import LaneLayout
from torchrec_hybrid.sharding.input_dist import HybridLookupInput


class HybridLookupOutput(NamedTuple):
    """The lanes' pooled outputs of one step (flat, lane after lane: cells.LaneLayout), with the step's input,
    whose send plan and sample side the output dist reads."""

    cold: torch.Tensor
    input: HybridLookupInput


def _decays(config: GroupedEmbeddingConfig) -> bool:
    """Whether the group's fused optimizer decays weights: FBGEMM's CPU kernels then decay a
    row once per feature that looks it up, so a table's rows must not be split over features."""
    return bool((config.fused_params or {}).get("weight_decay", 0.0))


def own_lane_pays(config: GroupedEmbeddingConfig, num_features: int, pooling_factor: Optional[float],
                  device: torch.device) -> bool:
    """Whether a heavy table of group ``config`` is better looked up in a TBE call of its own
    than as virtual features: only where that call reaches FBGEMM's fast CPU backward - on the
    CPU, with row-wise AdaGrad, one feature - and its bags are multi-hot (the plan's pooling
    factor; None, unknown: no; ``row_blocks.MULTI_HOT_POOLING``)."""
    optimizer = (config.fused_params or {}).get("optimizer")
    return (device.type == "cpu" and num_features == 1 and optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
            and (pooling_factor or 0.0) >= MULTI_HOT_POOLING)


def _lanes(configs: List[GroupedEmbeddingConfig], heavy: Set[int], world: int, own_lane: Set[int]):
    """The lanes of the groups (cells.LaneLayout): per group, its tables with rows here as
    one lane, each feature of a heavy table (``heavy``: indices in the sharding's table
    order) as ``world`` virtual features of the same table, except the heavy tables in
    ``own_lane`` (multi-hot bags, :func:`own_lane_pays`), which form a second lane of
    their own, without virtual features; with weight decay every heavy table goes to that lane
    (:func:`_decays`). Empty lanes are dropped. Returns the lanes' configs, per lane its
    features' indices in the sharding's order, and per feature its slots (set-up time loops)."""
    out: list = []
    features: List[List[int]] = []
    slots: List[int] = []
    t0 = f0 = 0
    for c in configs:
        decays = _decays(c)
        # per table: its lane (0: the group's, 1: the heavy tables' own) and its virtual features
        lane = [int(t0 + i in heavy and (decays or t0 + i in own_lane)) for i in range(len(c.embedding_tables))]
        n_slots = [world if t0 + i in heavy and not lane[i] else 1 for i in range(len(c.embedding_tables))]
        for g in (0, 1):
            tables: list = []
            fs: List[int] = []
            f = f0
            for i, t in enumerate(c.embedding_tables):
                nf = t.num_features()
                if lane[i] == g and t.local_rows > 0:  # a 0-row column slice: no TBE
                    n = n_slots[i]
                    names = [f"{name}@{v}" for name in t.feature_names for v in range(n)] if n > 1 else t.feature_names
                    tables.append(dataclasses.replace(t, feature_names=names))
                    fs.extend(range(f, f + nf))
                f += nf
            if tables:
                out.append(dataclasses.replace(c, embedding_tables=tables))
                features.append(fs)
        slots.extend(n for i, t in enumerate(c.embedding_tables) for n in [n_slots[i]] * t.num_features())
        t0, f0 = t0 + len(c.embedding_tables), f0 + c.num_features()
    return out, features, slots


def lanes_of(configs: List[GroupedEmbeddingConfig], heavy: Set[int], world: int, own_lane: Set[int],
             device: torch.device) -> Tuple[List[GroupedEmbeddingConfig], LaneLayout, List[List[str]]]:
    """The lanes of the groups (:func:`_lanes`): their configs (the lookup's TBE groups), their layout (what
    the input dist unpacks into) and each lane's feature names (the TBEs' keys)."""
    lane_configs, lane_features, slots = _lanes(configs, heavy, world, own_lane)
    layout = LaneLayout(lane_features, [d for c in configs for d in c.embedding_dims()], device, slots)
    return lane_configs, layout, [c.feature_names() for c in lane_configs]


class HybridLookup(BaseEmbeddingLookup[HybridLookupInput, HybridLookupOutput]):
    """The owner's cold row-wise fused lookup (plus its owned hot rows), one TBE call per lane.

    Args:
        lane_configs: the lanes' groups (:func:`lanes_of`: the stock row-wise shard of every hybrid
            table, heavy tables' features as virtual features or a lane of their own).
        pg / device / env: as for stock lookups.
    """

    def __init__(self, lane_configs: List[GroupedEmbeddingConfig], pg: dist.ProcessGroup, device: torch.device,
                 env: Optional[ShardingEnv] = None) -> None:
        super().__init__()
        self.cold = GroupedPooledEmbeddingsLookup(lane_configs, pg=pg, device=device,
                                                  sharding_type=ShardingType.ROW_WISE, env=env)
        self.lane_keys = [c.feature_names() for c in lane_configs]  # per lane (TBE call), its features' names

    @record_function("## hybrid:cold_lookup ##")
    def forward(self, sparse_features: HybridLookupInput) -> HybridLookupOutput:
        outs = _compat.grouped_lookup_forward(self.cold, sparse_features.lane_kjts) if sparse_features.lane_kjts \
            else []
        if not outs:  # no cold rows here (only 0-row slices): nothing to look up, but the output
            # all-to-all's backward must still run on this rank, so the empty output joins the graph
            cold = torch.zeros(0, device=sparse_features.lengths.device, requires_grad=torch.is_grad_enabled())
        else:
            cold = outs[0].reshape(-1) if len(outs) == 1 else torch.cat([o.reshape(-1) for o in outs])
        return HybridLookupOutput(cold, sparse_features)

    def flush(self) -> None:
        self.cold.flush()

    def purge(self) -> None:
        self.cold.purge()

    # The cold shard is the logical table: state_dict and parameters are the stock row-wise ones.
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.cold.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def named_parameters_by_table(self):
        return self.cold.named_parameters_by_table()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self.cold.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self.cold.named_buffers(prefix, recurse, remove_duplicate)
