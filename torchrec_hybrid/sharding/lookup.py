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

    cold: torch.Tensor  # [B', D]: partial sums of the non-empty received bags, owner side
    cold_rows: torch.Tensor  # [F, W * B]: row of ``cold`` holding each received bag (-1: empty)
    # () -> [B, D] sums over the local hot lookups. Called by the output dist *after* its
    # all-to-all, so in backward the hot gradient (and its all-reduce) comes first and
    # overlaps the reverse all-to-all.
    hot: Callable[[], torch.Tensor]
    received_lengths: torch.Tensor  # [F, W * B] cold ids received (owner side)
    sent_lengths: torch.Tensor  # [W, F, B] cold ids sent (sample side)
    lengths: torch.Tensor  # [F, B] full bag lengths


def _compact_bags(kjt: KeyedJaggedTensor, num_features: int):
    """Drops the empty bags of a received cold KJT (most of its ``W * B`` bags per feature).

    The TBE needs one batch size for all features, so feature f's non-empty bags take rows
    ``0..n_f-1`` and the batch is ``max n_f``; values keep their order. Returns the compact
    KJT and, per received bag, its row in the lookup output (-1 for empty bags).
    """
    lengths = kjt.lengths().view(num_features, -1)
    nonempty = lengths > 0
    rows = torch.cumsum(nonempty, dim=1, dtype=torch.int32) - 1
    batch = max(1, int(rows[:, -1].max()) + 1)
    rows = torch.where(nonempty, rows, -1)
    # scatter every bag's length to (feature, row); empty bags go to a trash slot at the end
    base = torch.arange(0, num_features * batch, batch, dtype=torch.int32, device=lengths.device)[:, None]
    dest = torch.where(nonempty, base + rows, num_features * batch)
    compact = torch.zeros(num_features * batch + 1, dtype=lengths.dtype, device=lengths.device)
    compact.scatter_(0, dest.view(-1).to(torch.int64), lengths.reshape(-1))
    out = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(),
                            lengths=compact[:-1], stride=batch)
    return out, rows


class HybridLookup(nn.Module):
    """Cold row-wise fused lookup + replicated hot lookup for the hybrid tables of one EBC."""

    def __init__(
        self,
        grouped_configs: List[GroupedEmbeddingConfig],
        hot_ids: List[List[torch.Tensor]],
        pg: dist.ProcessGroup,
        device: torch.device,
        env: Optional[ShardingEnv] = None,
    ) -> None:
        super().__init__()
        self.cold = GroupedPooledEmbeddingsLookup(
            grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        cold_tbes = [m.emb_module for m in _compat.grouped_lookup_modules(self.cold)]
        self._hot = [HotReplica(c, h, tbe, pg, device)
                     for c, h, tbe in zip(grouped_configs, hot_ids, cold_tbes)]
        self._feature_splits = [c.num_features() for c in grouped_configs]
        self._slot_splits = [r.num_slots for r in self._hot]
        self.refresh_hot()

    def forward(self, inp: HybridLookupInput) -> HybridLookupOutput:
        B = inp.lengths.size(1)
        with record_function("## hybrid:cold_lookup ##"):
            compact, cold_rows = _compact_bags(inp.cold, sum(self._feature_splits))
            cold = self.cold(compact)

        @record_function("## hybrid:hot_lookup ##")
        def hot() -> torch.Tensor:
            out = []
            offsets = inp.hot_offsets
            f0 = s0 = 0
            for replica, nf, ns in zip(self._hot, self._feature_splits, self._slot_splits):  # per group
                off = offsets[f0 * B: (f0 + nf) * B + 1]
                lo, hi = off[0], off[-1]
                w = None if inp.hot_weights is None else inp.hot_weights[lo:hi]
                out.append(replica.pool(inp.hot_indices[lo:hi], off - lo, w, inp.hot_counts[s0:s0 + ns], B))
                f0, s0 = f0 + nf, s0 + ns
            return torch.cat(out, dim=1) if len(out) > 1 else out[0]

        return HybridLookupOutput(
            cold=cold,
            cold_rows=cold_rows,
            hot=hot,
            received_lengths=inp.cold.lengths().view(sum(self._feature_splits), -1),
            sent_lengths=inp.sent_lengths,
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
