"""Lookup of the frequency-hybrid sharding: cold rows on their owner, hot rows locally.

The cold part is TorchRec's own ``GroupedPooledEmbeddingsLookup`` over the row-wise shard
(fused TBEs, fused optimizer, state_dict all stock); besides the received bags it looks up
the hot rows this rank owns, as one-id bags, so they can be sent to every replica and be
updated by the fused optimizer in backward. The hot part is one :class:`HotPooling` per
table group, pooled once the replica has arrived. The output keeps both unreduced; the
output dist routes the cold partial sums and the hot rows, and adds the sums up.
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Set

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.cells import LaneLayout
from torchrec_hybrid.sharding.cold_all_to_all import ExtraBags
from torchrec_hybrid.sharding.hot_replica import HotRowLayout
from torchrec_hybrid.sharding.input_dist import HybridLookupInput


@dataclass
class HybridLookupOutput:
    """Unreduced pooled embeddings of one step, handed to the output dist."""

    cold: torch.Tensor  # owner side, flat: received bags' partial sums + owned hot rows (lanes)
    # the received bags in (source rank, feature, sample) order - the order they travel
    # home in - as positions in ``cold``'s units (cells.py); and how many per [rank, feature]
    cold_bag_pos: torch.Tensor
    cold_bag_counts: torch.Tensor
    # the owned hot rows this rank sends to every rank (one-id bags of ``cold``), as
    # positions, in sync order (hot_replica.HotRowLayout)
    hot_row_pos: torch.Tensor
    # (replica) -> [B, D] sums over the local hot lookups. Called by the output dist once the
    # replica has arrived; its gradient flows back to the owners through the same route.
    hot: Callable[[torch.Tensor], torch.Tensor]
    hot_slots: torch.Tensor  # slots every rank receives, owner after owner (sync order)
    hot_counts: torch.Tensor  # how many per owner [W]
    layout: HotRowLayout  # the hot set these slots number (hot_state.py)
    sent_cells: torch.Tensor  # sample side: the bags sent, (owner, feature, sample) order,
    sent_counts: torch.Tensor  # as cells ``sample * F + feature``; how many per [W, F]
    lengths: torch.Tensor  # [F, B] full bag lengths
    # the output all-to-all's split sizes (units) per rank, known on the host since the cold
    # exchange: partial sums this rank returns to it, and that it returns to this rank
    host_return_units: List[int]
    host_partial_units: List[int]


def cold_positions(lanes: LaneLayout, inp: HybridLookupInput, extra: ExtraBags, q: torch.Tensor,
                   feature: torch.Tensor, rows_per_feature: torch.Tensor, batches: List[int]):
    """Where the received bags (``q``-th of ``feature``, arrival order) and the owned hot rows'
    extra bags (after each feature's received ones) lie in the owner's cold output, in units
    (cells.LaneLayout.positions, one call for both); the totals come from the host copies the cold
    exchange made, so no sync."""
    returned = inp.cold.host_return_units
    bag_units = q.numel() if lanes.one_unit else sum(returned or [])
    row_q = rows_per_feature.index_select(0, extra.features) + extra.rank
    pos = lanes.positions(torch.cat([q, row_q]), torch.cat([feature, extra.features]), batches,
                          bag_units + lanes.units_of(extra.host_per_feature))
    return pos[:bag_units], pos[bag_units:]


def _decays(config: GroupedEmbeddingConfig) -> bool:
    """Whether the group's fused optimizer decays weights: FBGEMM's CPU kernels then decay a
    row once per feature that looks it up, so a table's rows must not be split over features."""
    return bool((config.fused_params or {}).get("weight_decay", 0.0))


# A heavy table whose bags hold at least this many ids on average (the plan's pooling factor)
# gets a TBE call of its own instead of virtual features (:func:`own_lane_pays`): FBGEMM's CPU
# backward takes its vectorised path (fbgemm's SpMDM + rowwise-AdaGrad kernels) only for
# EXACT_ROWWISE_ADAGRAD on a table looked up by one feature, and a shared table's scalar path
# cost the owner of the DLRMv2 multi-hot tables' heaviest bags ~2x its backward; a second call
# and the concatenation of the two outputs cost more than that path with one id per bag
# (docs/architecture.md §2, step 3).
MULTI_HOT_POOLING = 2.0


def own_lane_pays(config: GroupedEmbeddingConfig, num_features: int, pooling_factor: Optional[float],
                  device: torch.device) -> bool:
    """Whether a heavy table of group ``config`` is better looked up in a TBE call of its own
    than as virtual features: only where that call reaches FBGEMM's fast CPU backward - on the
    CPU, with row-wise AdaGrad, one feature - and its bags are multi-hot (the plan's pooling
    factor; None, unknown: no)."""
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


class HybridLookup(nn.Module):
    """Cold row-wise fused lookup (plus the owned hot rows) and local hot pooling for one EBC.

    The hot set comes with each step's input (``inp.hot``, hot_state.py), so a refresh
    between steps never mixes two.

    Args:
        grouped_configs: the cold groups (stock row-wise shard of every hybrid table).
        pg / device / env: as for stock lookups.
        heavy_tables: tables (indices in the groups' table order) whose cold rows are mostly on
            this rank: each of their features looked up as W virtual features (cells.LaneLayout).
        own_lane_tables: the heavy tables with multi-hot bags (:func:`own_lane_pays`): looked up in
            a TBE call of their own instead, without virtual features (:func:`_lanes`).
    """

    def __init__(
        self,
        grouped_configs: List[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup,
        device: torch.device,
        env: Optional[ShardingEnv] = None,
        heavy_tables: Optional[Set[int]] = None,
        own_lane_tables: Optional[Set[int]] = None,
    ) -> None:
        super().__init__()
        self._feature_splits = [c.num_features() for c in grouped_configs]
        self._num_features = sum(self._feature_splits)
        lane_configs, lane_features, slots = _lanes(grouped_configs, set(heavy_tables or ()), pg.size(),
                                                      set(own_lane_tables or ()))
        self.cold = GroupedPooledEmbeddingsLookup(
            lane_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self._lane_keys = [c.feature_names() for c in lane_configs]
        self._lanes = LaneLayout(lane_features, [d for c in grouped_configs for d in c.embedding_dims()], device,
                                 slots)
        self._extra: Optional[tuple] = None

    def forward(self, inp: HybridLookupInput) -> HybridLookupOutput:
        B = inp.lengths.size(1)
        state = inp.hot
        layout = state.layout
        replicas = state.replicas
        mine, hot_slots, hot_counts = layout.select(None if inp.touched is None else inp.touched())
        if self._extra is None or self._extra[0] is not mine:  # the same every step when all rows travel
            self._extra = (mine, ExtraBags(layout.feature[mine], layout.row[mine], self._num_features))
        extra = self._extra[1]
        with record_function("## hybrid:cold_lookup ##"):
            kjts, batches, rows_per_feature, (q, feature) = inp.cold.lane_inputs(self._lanes, self._lane_keys, extra)
            outs = _compat.grouped_lookup_forward(self.cold, kjts) if kjts else []
            if not outs:  # no cold rows here (only 0-row slices): nothing to look up, but the output
                # all-to-all's backward must still run on this rank, so the empty output joins the graph
                cold = torch.zeros(0, device=inp.lengths.device, requires_grad=torch.is_grad_enabled())
            else:
                cold = outs[0].reshape(-1) if len(outs) == 1 else torch.cat([o.reshape(-1) for o in outs])
        bag_pos, row_pos = cold_positions(self._lanes, inp, extra, q, feature, rows_per_feature, batches)

        @record_function("## hybrid:hot_lookup ##")
        def hot(replica: torch.Tensor) -> torch.Tensor:
            if len(replicas) == 1:
                return replicas[0].pool(replica, inp.hot_indices, inp.hot_offsets, inp.hot_weights, B)
            out = []
            for g, (rep, nf, base) in enumerate(zip(replicas, self._feature_splits, layout.flat_bases)):  # per group
                f0 = sum(self._feature_splits[:g])  # the group's offsets index into every group's lookups
                out.append(rep.pool(replica[base:base + rep.flat_size], inp.hot_indices,
                                    inp.hot_offsets[f0 * B: (f0 + nf) * B + 1], inp.hot_weights, B))
            return torch.cat(out, dim=1)

        return HybridLookupOutput(
            cold=cold,
            cold_bag_pos=bag_pos,
            cold_bag_counts=inp.cold.bag_counts,
            hot_row_pos=row_pos,
            hot=hot,
            hot_slots=hot_slots,
            hot_counts=hot_counts,
            layout=layout,
            sent_cells=inp.sent_cells[:inp.cold.host_sent_bags],
            sent_counts=inp.sent_counts,
            lengths=inp.lengths,
            host_return_units=inp.cold.host_return_units or [],
            host_partial_units=inp.cold.host_partial_units or [],
        )

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
