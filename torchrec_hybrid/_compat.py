"""Every private TorchRec / FBGEMM / PyTorch attribute this package touches, in one place.

TorchRec 1.8 and FBGEMM 1.8 expose no public API for these; if an upgrade renames one,
this is the only file to change.
"""

from typing import List, Sequence

import torch
from torch import nn

# --- FBGEMM TBE storage ---------------------------------------------------------------

_WEIGHT_BASES = ("weights_dev", "weights_host", "weights_uvm")
_STATE_BASES = (
    "momentum1_dev", "momentum1_host", "momentum1_uvm",
    "momentum2_dev", "momentum2_host", "momentum2_uvm",
)


def _base_of(tbe: nn.Module, view: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    ptr = view.untyped_storage().data_ptr()
    for n in names:
        base = getattr(tbe, n, None)
        if base is not None and base.numel() > 0 and base.untyped_storage().data_ptr() == ptr:
            return base
    raise RuntimeError(f"TBE tensor is not a view of any of {names}: cannot address it in place")


def tbe_weight_base(tbe: nn.Module) -> torch.Tensor:
    """The flat weight tensor of a TBE (``weights_dev`` on CUDA, ``weights_host`` on CPU)."""
    return _base_of(tbe, tbe.split_embedding_weights()[0], _WEIGHT_BASES)


def tbe_state_views(tbe: nn.Module) -> List[List[torch.Tensor]]:
    """Per optimizer state (momentum1, momentum2, ...), the per-table views of a TBE.

    ``split_optimizer_states()`` returns [table][state]; we transpose to [state][table].
    """
    per_table = tbe.split_optimizer_states()
    if not per_table:
        return []
    return [list(s) for s in zip(*per_table)]


def tbe_state_base(tbe: nn.Module, view: torch.Tensor) -> torch.Tensor:
    return _base_of(tbe, view, _STATE_BASES)


def flat_positions(base: torch.Tensor, view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Flat indices into ``base`` of the given rows of ``view`` (a 1-D or 2-D view of base)."""
    start = view.storage_offset() - base.storage_offset()
    if view.dim() == 1:
        return start + rows * view.stride(0)
    cols = torch.arange(view.size(1), dtype=torch.int64)
    return (start + rows[:, None] * view.stride(0) + cols[None, :] * view.stride(1)).reshape(-1)


# --- PyTorch autograd --------------------------------------------------------------------------

def queue_end_of_backward(callback) -> None:
    """Runs ``callback`` once the current backward pass has finished (as DDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# --- TorchRec internals -------------------------------------------------------------------

def grouped_lookup_modules(lookup: nn.Module) -> List[nn.Module]:
    """The per-group kernels (``BatchedFusedEmbeddingBag``) of a GroupedPooledEmbeddingsLookup."""
    return list(lookup._emb_modules)


def sharding_grouped_configs(sharding) -> list:
    """The GroupedEmbeddingConfigs a stock row-wise sharding computed for this rank."""
    return sharding._grouped_embedding_configs


def sebc_lookups(sebc) -> list:
    return sebc._lookups


def sebc_fix_mean_pooling(sebc, divided_after_dist: set) -> None:
    """Wire SEBC's MEAN-pooling callback so it divides exactly ``divided_after_dist``.

    The stock divisor divides every feature *not* listed under "SUM" (a stock bug when a
    row-wise MEAN table shares an EBC with other types), so we list every other feature there.
    """
    if "MEAN" not in sebc._pooling_type_to_rs_features:
        return
    all_features = [f for c in sebc._embedding_bag_configs for f in c.feature_names]
    sebc._pooling_type_to_rs_features["SUM"] = sorted(set(all_features) - divided_after_dist)
    sebc._pooling_type_to_rs_features["MEAN"] = sorted(divided_after_dist)
    if not divided_after_dist:
        del sebc._pooling_type_to_rs_features["MEAN"]
    sebc._has_mean_pooling_callback = bool(divided_after_dist)
