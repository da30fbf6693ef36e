"""Variable batch per feature (VBE) for frequency_hybrid: expand to one batch at the input.

A VBE ``KeyedJaggedTensor`` holds, per feature f, ``stride_per_key()[f]`` distinct bags and
``inverse_indices`` ``[F, B]`` naming, for each of the B samples, which of f's bags it uses.
Stock sharded EBCs pool the distinct bags and expand the pooled rows with the inverse
indices at the end; the user gets ``[B, sum(dims)]`` either way. The hybrid dists assume one
batch for every feature, so a hybrid module expands the KJT itself before its input dist:
sample b of feature f gets a copy of bag ``inverse_indices[f, b]`` (ids and weights). Outputs
and gradients are the same sums (a distinct bag's gradient is the sum of its copies');
the price is the duplicated bags' bytes and lookups, and one host sync per step to size the
expanded values (the stock VBE path has its own).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid.sharding.segments import exclusive_cumsum, host_to_device, segment_positions

# what can be wrong with a VBE batch: (kind, index, value) with index a key position or a count
NO_INVERSE = "no_inverse_indices"
INVERSE_KEYS = "inverse_keys"
INVERSE_RANGE = "inverse_range"
BAGS_SIZE = "bags_size"
VALUES_SIZE = "values_size"  # (sum of the lengths, values numel)
WEIGHTS_SIZE = "weights_size"  # (values numel, weights numel)
NEGATIVE_LENGTH = "negative_length"  # (key position, the length)


def expand_variable_batch(kjt: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, Optional[Tuple[str, int, int]]]:
    """``kjt`` with every feature at the inverse indices' batch B (values, weights, lengths),
    or ``(kjt, problem)`` when it cannot be expanded: no inverse indices, inverse indices for
    other keys or of the wrong shape, an inverse index outside its feature's bags, lengths
    that do not match the strides, a negative length, values or weights that do not match the
    lengths (the expanded batch would hide the last three: it copies only the bags samples name).
    Vectorised; one host read (the expanded size, the first bad index and the lengths' sum and
    minimum together)."""
    keys: List[str] = list(kjt.keys())
    inverse = kjt.inverse_indices_or_none()
    if inverse is None:
        return kjt, (NO_INVERSE, -1, 0)
    inv_keys, inv = inverse
    if list(inv_keys) != keys or inv.dim() != 2 or inv.size(0) != len(keys):
        return kjt, (INVERSE_KEYS, -1, inv.size(0) if inv.dim() else 0)
    device = kjt.values().device
    strides = host_to_device(kjt.stride_per_key(), device)
    lengths = kjt.lengths()
    if lengths.numel() != int(sum(kjt.stride_per_key())):
        return kjt, (BAGS_SIZE, int(sum(kjt.stride_per_key())), lengths.numel())
    inv = inv.to(torch.int64)
    bad = (inv < 0) | (inv >= strides[:, None])
    bag = (inv.clamp(min=0) + exclusive_cumsum(strides)[:, None]).reshape(-1)  # [F * B], feature-major
    bag = torch.where(bad.reshape(-1), 0, bag).clamp(max=max(lengths.numel() - 1, 0))
    new_lengths = lengths.index_select(0, bag) if lengths.numel() else torch.zeros_like(bag, dtype=lengths.dtype)
    found, first = bad.reshape(-1).max(0)
    shortest = lengths.min().to(torch.int64) if lengths.numel() else torch.zeros((), dtype=torch.int64)
    total, any_bad, first_bad, given, least = torch.stack([
        new_lengths.sum().to(torch.int64), found.to(torch.int64), first, lengths.sum().to(torch.int64),
        shortest.to(device)]).tolist()
    if any_bad:
        f, b = divmod(first_bad, inv.size(1))
        return kjt, (INVERSE_RANGE, f, int(inverse[1][f, b]))
    values, weights = kjt.values(), kjt.weights_or_none()
    if given != values.numel():
        return kjt, (VALUES_SIZE, given, values.numel())
    if weights is not None and weights.numel() != values.numel():
        return kjt, (WEIGHTS_SIZE, values.numel(), weights.numel())
    if least < 0:  # which key's bag (on this error path only)
        first_negative = int((lengths < 0).nonzero()[0, 0])
        key = int((torch.tensor(kjt.stride_per_key()).cumsum(0) <= first_negative).sum())
        return kjt, (NEGATIVE_LENGTH, key, least)
    starts = kjt.offsets().to(torch.int64).index_select(0, bag) if bag.numel() else bag
    index = segment_positions(starts, new_lengths.to(torch.int64), total)
    return KeyedJaggedTensor(
        keys=keys, values=values.index_select(0, index), lengths=new_lengths,
        weights=None if weights is None else weights.index_select(0, index), stride=inv.size(1),
    ), None
