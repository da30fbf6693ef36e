"""Small vectorised helpers on segmented (jagged) index ranges."""

import functools
import itertools
from typing import List, Optional, Sequence, Tuple, Union

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch


def exclusive_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Starts of consecutive segments of sizes ``x``: ``cumsum(x) - x``, int64 for integer ``x``
    (one FBGEMM op for a 1-D int64 ``x``, the common case: a dispatched op, or a kernel launch
    on a GPU, fewer; FBGEMM's keeps an int32 input's dtype, so int32 takes the torch path)."""
    if x.dim() == 1 and x.dtype == torch.int64:
        return torch.ops.fbgemm.asynchronous_exclusive_cumsum(x)
    return torch.cumsum(x, dim) - x


def segment_arange(lengths: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """``cat([arange(n) for n in lengths])`` without a Python loop (``total``: its length, if known)."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum()) if total is None else total
    starts = exclusive_cumsum(lengths)
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths, output_size=total)


def segment_positions(base: torch.Tensor, lengths: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """``cat([base[i] + arange(lengths[i])])``: flat element positions of segments (one repeat of
    each segment's shift, ``base - start``, onto an arange)."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum()) if total is None else total
    shift = base - exclusive_cumsum(lengths)
    return torch.arange(total, device=lengths.device) + torch.repeat_interleave(shift, lengths, output_size=total)


def starts(sizes: Sequence[int]) -> List[int]:
    """Host ints: where consecutive segments of ``sizes`` start (the exclusive prefix sum)."""
    return [0, *itertools.accumulate(sizes)][:len(sizes)]


def host_segment_positions(base: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """:func:`segment_positions` of segments known on the host: their shifts and lengths reach the device
    in one copy (:func:`host_to_device`), no sync."""
    shift = [b - a for b, a in zip(base, starts(lengths))]
    total = sum(lengths)
    both = host_to_device(shift + list(lengths), device)
    k = len(shift)
    return torch.arange(total, device=device) + torch.repeat_interleave(both[:k], both[k:], output_size=total)


def round_robin_order(lists: int, n: int, device: torch.device) -> torch.Tensor:
    """Segment order taking run i of each of ``lists`` lists (``n`` runs each) in turn:
    ``0, n, 2n, ..., 1, n+1, ...`` (for FBGEMM's ``permute_1D_sparse_data``)."""
    return torch.arange(lists * n, dtype=torch.int32, device=device).view(lists, n).t().reshape(-1)


@functools.lru_cache(maxsize=64)
def cached_tensor(data: Union[int, Tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor (``data``: an int for a 0-dim one, else a tuple), built once per dtype and
    device and shared: never write to it."""
    return torch.tensor(data, dtype=dtype, device=device)


def host_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on ``device`` without waiting for the device: a plain
    ``torch.tensor(values, device=cuda)`` copies from pageable memory and blocks until the
    stream has drained (a host sync per call); a pinned buffer and an asynchronous copy do not
    (PyTorch's caching host allocator keeps the buffer until the copy is done)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":  # the CPU itself, or a device without pinned host memory here (meta)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
