"""Lookup of the frequency-hybrid sharding: cold rows on their owner, hot rows locally.

The cold part is TorchRec's own ``GroupedPooledEmbeddingsLookup`` over the row-wise shard
(fused TBEs, fused optimizer, state_dict all stock). The hot part is one
:class:`HotReplica` per table group. The output keeps both unreduced; the output dist
routes the cold partial sums home and adds them to the hot sums.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.hot_replica import HotReplica
from torchrec_hybrid.sharding.input_dist import HybridLookupInput


@dataclass
class HybridLookupOutput:
    """Unreduced pooled embeddings of one step, handed to the output dist."""

    cold: torch.Tensor  # [B', D]: partial sums of the received bags, owner side
    # the received bags in (source rank, feature, sample) order - the order they travel
    # home in - as cells ``row * F + feature`` of ``cold``; and how many per [rank, feature]
    cold_bag_cells: torch.Tensor
    cold_bag_counts: torch.Tensor
    # () -> [B, D] sums over the local hot lookups. Called by the output dist *after* its
    # all-to-all, so in backward the hot gradient (and its all-reduce) comes first and
    # overlaps the reverse all-to-all.
    hot: Callable[[], torch.Tensor]
    sent_cells: torch.Tensor  # sample side: the bags sent, (owner, feature, sample) order,
    sent_counts: torch.Tensor  # as cells ``sample * F + feature``; how many per [W, F]
    lengths: torch.Tensor  # [F, B] full bag lengths


def _padded_bags(kjt: KeyedJaggedTensor):
    """The received bags (variable batch per feature and source rank) as a fixed-batch KJT.

    The TBE needs one batch size for all features (FBGEMM's CPU variable-batch kernel is
    far slower than padding), so feature f's bags take rows ``0..n_f-1`` in received order
    and the batch is ``max n_f``; values keep their order. Returns the padded KJT, and the
    bags in (source rank, feature, sample) order - the order they travel home in - as cells
    ``row * F + feature`` of the lookup output, with their counts ``[W, F]``.
    """
    counts = torch.tensor(kjt.stride_per_key_per_rank(), device=kjt.device())  # [F, W]
    F, W = counts.shape
    lengths = kjt.lengths()
    n = lengths.numel()
    per_feature = counts.sum(1)
    batch = max(1, int(per_feature.max()))
    feature_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(per_feature)
    padded = torch.ops.fbgemm.jagged_1d_to_dense(lengths, feature_offsets, batch, 0).view(-1)
    out = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(),
                            lengths=padded, stride=batch, length_per_key=kjt.length_per_key())
    # Block (w, f) of the send order holds rows first[f, w] ...  of feature f, so the p-th
    # bag sent is cell (p - block_start + first) * F + f of its block.
    first = (torch.cumsum(counts, 1) - counts).t().reshape(-1)
    size = counts.t().reshape(-1)
    block_start = torch.cumsum(size, 0) - size
    shift = (first - block_start) * F + torch.arange(W * F, device=counts.device) % F
    cells = torch.arange(n, device=counts.device) * F + torch.repeat_interleave(shift, size, output_size=n)
    return out, cells, size.view(W, F)


class HybridLookup(nn.Module):
    """Cold row-wise fused lookup + replicated hot lookup for the hybrid tables of one EBC."""

    def __init__(
        self,
        grouped_configs: List[GroupedEmbeddingConfig],
        hot_ids: List[List[torch.Tensor]],
        slot_bases: List[int],
        pg: dist.ProcessGroup,
        device: torch.device,
        env: Optional[ShardingEnv] = None,
    ) -> None:
        super().__init__()
        self.cold = GroupedPooledEmbeddingsLookup(
            grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        cold_tbes = [m.emb_module for m in _compat.grouped_lookup_modules(self.cold)]
        self._hot = [HotReplica(c, h, tbe, pg, device, slot_base=s)
                     for c, h, tbe, s in zip(grouped_configs, hot_ids, cold_tbes, slot_bases)]
        self._feature_splits = [c.num_features() for c in grouped_configs]
        self._slot_splits = [r.num_slots for r in self._hot]
        self.refresh_hot()

    def forward(self, inp: HybridLookupInput) -> HybridLookupOutput:
        B = inp.lengths.size(1)
        with record_function("## hybrid:cold_lookup ##"):
            padded, cells, counts = _padded_bags(inp.cold)
            cold = self.cold(padded)

        @record_function("## hybrid:hot_lookup ##")
        def hot() -> torch.Tensor:
            if len(self._hot) == 1:
                return self._hot[0].pool(inp.hot_indices, inp.hot_offsets, inp.hot_weights, inp.hot_counts, B)
            out = []
            offsets = inp.hot_offsets
            f0 = s0 = 0
            for replica, nf, ns in zip(self._hot, self._feature_splits, self._slot_splits):  # per group
                off = offsets[f0 * B: (f0 + nf) * B + 1]
                lo, hi = off[0], off[-1]
                w = None if inp.hot_weights is None else inp.hot_weights[lo:hi]
                out.append(replica.pool(inp.hot_indices[lo:hi], off - lo, w, inp.hot_counts[s0:s0 + ns], B))
                f0, s0 = f0 + nf, s0 + ns
            return torch.cat(out, dim=1)

        return HybridLookupOutput(
            cold=cold,
            cold_bag_cells=cells,
            cold_bag_counts=counts,
            hot=hot,
            sent_cells=inp.sent_cells,
            sent_counts=inp.sent_counts,
            lengths=inp.lengths,
        )

    def refresh_hot(self) -> None:
        """Copy the owners' shadow rows into every hot replica (collective)."""
        for r in self._hot:
            r.refresh()

    def flush(self) -> None:
        self.cold.flush()
        for r in self._hot:
            r.to_shadow()

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

    def hot_replicas(self) -> List[HotReplica]:
        return list(self._hot)
