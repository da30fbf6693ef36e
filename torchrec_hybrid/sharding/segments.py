"""Small vectorised helpers on segmented (jagged) index ranges."""

import torch


def segment_arange(lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(n) for n in lengths])`` without a Python loop."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths, output_size=total)


def segment_positions(base: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([base[i] + arange(lengths[i])])``: flat element positions of segments."""
    return torch.repeat_interleave(base, lengths) + segment_arange(lengths)
