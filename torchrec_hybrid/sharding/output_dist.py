"""Output dist of the frequency-hybrid sharding: a sparse all-to-all of cold partial sums.

Only the partial pooled vectors of (feature, sample) bags that had cold ids on an owner go
back to the sample's rank, so the bytes scale with cold lookups, not with ``B * dim``. Both
sides know the split sizes from lengths they already hold (the owner from what it received,
the sample's rank from what it sent): no extra metadata round-trip. The backward runs the
same all-to-all in reverse and, like TorchRec's pooled all-to-all, divides by W.
MEAN features are pooled as SUM on both paths and divided by the full bag length here.
"""

from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.types import Awaitable

from torchrec_hybrid.sharding.lookup import HybridLookupOutput
from torchrec_hybrid.sharding.segments import segment_positions


class _VariableAllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes, differentiable (reverse splits in backward)."""

    @staticmethod
    def forward(ctx, values, send_splits, recv_splits, pg):
        ctx.splits, ctx.pg = (send_splits, recv_splits), pg
        out = values.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, values.contiguous(), recv_splits, send_splits, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty(sum(send_splits))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.pg)
        if get_gradient_division():
            out = out / ctx.pg.size()
        return out, None, None, None


class _GatherBags(torch.autograd.Function):
    """``cold[positions]`` (rows or elements of the owner's padded lookup output).

    Backward scatters into an *uninitialised* buffer: the positions cover every non-empty
    bag, and the rest of the buffer holds padding bags without ids, whose gradient rows the
    TBE backward never reads. Spares zero-filling the whole padded output every step.
    """

    @staticmethod
    def forward(ctx, cold, positions):
        ctx.save_for_backward(positions)
        ctx.shape = cold.shape
        return cold.index_select(0, positions)

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        return grad.new_empty(ctx.shape).index_copy_(0, positions, grad), None


class _AddPartials(torch.autograd.Function):
    """``hot`` += received partials at their rows, in place (hot is a fresh, private tensor).

    Spares the copy of an out-of-place ``index_add`` and, unlike an in-place op on a view,
    autograd's CopySlices machinery, which clones the whole gradient.
    """

    @staticmethod
    def forward(ctx, hot, received, positions, width):
        ctx.save_for_backward(positions)
        ctx.width = width
        hot.view(-1, width).index_add_(0, positions, received.view(-1, width))
        ctx.mark_dirty(hot)
        return hot

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        return grad, grad.reshape(-1, ctx.width).index_select(0, positions).view(-1), None, None


class _Done(Awaitable):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> torch.Tensor:
        return self._value


class HybridPooledEmbeddingDist(nn.Module):
    """Sends cold partial sums home and adds them to the hot sums -> ``[B, sum(dims)]``.

    Args:
        pg: process group.
        feature_dims: output width of each feature (sharding order).
        mean_features: which features use MEAN pooling.
    """

    def __init__(self, pg: dist.ProcessGroup, feature_dims: List[int], mean_features: List[bool],
                 device: torch.device) -> None:
        super().__init__()
        self._pg, self._world = pg, pg.size()
        dims = torch.tensor(feature_dims, dtype=torch.int64)
        self._total_dim = int(dims.sum())
        self.register_buffer("_dims", dims.to(device), persistent=False)
        self.register_buffer("_dim_offsets", (torch.cumsum(dims, 0) - dims).to(device), persistent=False)
        self._any_mean = any(mean_features)
        # all features one width: move whole rows instead of computing element positions
        self._uniform_dim = feature_dims[0] if len(set(feature_dims)) == 1 else None
        mean_cols = torch.repeat_interleave(torch.tensor(mean_features, dtype=torch.bool), dims)
        self.register_buffer("_mean_cols", mean_cols.to(device), persistent=False)

    def _positions(self, cells: torch.Tensor, counts: torch.Tensor):
        """Positions of bags (cells ``row * F + feature``) in an output, and per-rank counts.

        Positions are rows of the output viewed as ``[-1, D]`` when every feature has width
        D (then they are the cells), else flat element positions. ``counts`` [W, F] are the
        bags per (rank, feature); the returned counts are elements per rank.
        """
        if self._uniform_dim is not None:
            return cells, (counts.sum(1) * self._uniform_dim).tolist()
        F = self._dims.numel()
        feat, row = cells % F, torch.div(cells, F, rounding_mode="floor")
        per_rank = (counts.to(torch.int64) * self._dims[None, :]).sum(1).tolist()
        pos = segment_positions(row * self._total_dim + self._dim_offsets[feat], self._dims[feat])
        return pos, per_rank

    @record_function("## hybrid:output_dist ##")
    def forward(self, out: HybridLookupOutput, sharding_ctx=None) -> Awaitable[torch.Tensor]:
        # owner side: the bags received, in (source rank, feature, sample) order
        send_pos, send_splits = self._positions(out.cold_bag_cells, out.cold_bag_counts)
        # sample side: the bags we sent, in the same order (their rows are their samples)
        recv_pos, recv_splits = self._positions(out.sent_cells, out.sent_counts)
        D = self._uniform_dim
        partials = _GatherBags.apply(out.cold.reshape(-1, D) if D else out.cold.reshape(-1), send_pos).reshape(-1)
        received = _VariableAllToAll.apply(partials, send_splits, recv_splits, self._pg)
        pooled = _AddPartials.apply(out.hot(), received, recv_pos, D or 1)
        if self._any_mean:
            per_col = torch.repeat_interleave(out.lengths.t(), self._dims, dim=1, output_size=self._total_dim)
            divisor = torch.where(self._mean_cols[None, :], per_col.clamp(min=1), torch.ones_like(per_col))
            pooled = pooled / divisor.to(pooled.dtype)
        return _Done(pooled)
