"""Small vectorised helpers on segmented (jagged) index ranges."""

from typing import Optional, Tuple

import torch


def exclusive_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Starts of consecutive segments of sizes ``x``: ``cumsum(x) - x``."""
    return torch.cumsum(x, dim) - x


def segment_arange(lengths: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """``cat([arange(n) for n in lengths])`` without a Python loop (``total``: its length, if known)."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum()) if total is None else total
    starts = exclusive_cumsum(lengths)
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths, output_size=total)


def segment_positions(base: torch.Tensor, lengths: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """``cat([base[i] + arange(lengths[i])])``: flat element positions of segments."""
    arange = segment_arange(lengths, total)
    return torch.repeat_interleave(base, lengths, output_size=arange.numel()) + arange


def interleave_order(n: int, device: torch.device) -> torch.Tensor:
    """Segment order ``0, n, 1, n+1, ...``: run i of one list, then run i of a second."""
    return torch.arange(2 * n, dtype=torch.int32, device=device).view(2, n).t().reshape(-1)


def interleave_runs(order: torch.Tensor, sizes_a: torch.Tensor, a: torch.Tensor, sizes_b: torch.Tensor,
                    b: torch.Tensor, weights_a: Optional[torch.Tensor] = None,
                    weights_b: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``a_0, b_0, a_1, b_1, ...`` from ``a`` (runs of ``sizes_a``) and ``b`` (runs of ``sizes_b``).

    One FBGEMM segment permutation (``order`` from :func:`interleave_order`); weights, when
    given, move with their values.
    """
    sizes = torch.cat([sizes_a, sizes_b]).to(torch.int32)
    weights = None if weights_a is None else torch.cat([weights_a, weights_b])
    _, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(order, sizes, torch.cat([a, b]), weights)
    return values, weights
