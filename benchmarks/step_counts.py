"""Per-step counts of collectives, host syncs and dispatched ops: the GPU proxy on CPU boxes.

On a GPU each collective pays NCCL's latency and each device-to-host sync stalls the stream,
whatever the bytes; on these CPU machines neither shows in the time. So the benchmark counts
them, with a ``TorchDispatchMode`` that sees every op the dispatcher runs (forward and
backward, ours and TorchRec's alike), not by hand:

- collectives: ``c10d::`` ops (all-to-all, all-gather, all-reduce, ...), barriers excluded;
- host syncs: ops whose result the host must wait for on a GPU - scalar reads
  (``aten::_local_scalar_dense``: ``int(t)``, ``t.item()``), ``aten::equal``, ops with a
  data-dependent output size (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
  ``repeat_interleave`` without ``output_size``, indexing with a boolean mask - ``x[mask]``,
  ``x[mask] = v`` -, FBGEMM's ``masked_select_jagged_1d``), and tensor-to-Python
  conversions that bypass the dispatcher (``Tensor.tolist``, counted by wrapping it);
- ops: every dispatched op.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Dict, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the documented home of dispatch modes

_SYNC_OPS = {"aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::masked_select", "aten::unique",
             "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "fbgemm::masked_select_jagged_1d",
             "aten::bincount"}  # bincount: its length is the largest value's (a host read on a GPU)
# ops that read a boolean mask index on the host (``x[mask]``, ``x[mask] = v``): counted only with a mask
_MASK_INDEX_OPS = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
_NOT_COLLECTIVES = {"c10d::barrier"}


class StepCounter(TorchDispatchMode):
    """Counts, while active, the ops dispatched, the collectives and the host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name().split(".")[0]
        self.ops[name] += 1
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            self.ops["<sync> repeat_interleave without output_size"] += 1
        if name in _MASK_INDEX_OPS and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()):
            self.ops[f"<sync> {name} with a boolean mask"] += 1
        return func(*args, **kwargs)

    def summary(self) -> Dict[str, int]:
        syncs = sum(n for k, n in self.ops.items() if k in _SYNC_OPS or k.startswith("<sync>"))
        collectives = sum(n for k, n in self.ops.items() if k.startswith("c10d::") and k not in _NOT_COLLECTIVES)
        ops = sum(n for k, n in self.ops.items() if not k.startswith("<"))
        return {"collectives": collectives, "host_syncs": syncs, "ops": ops}


@contextlib.contextmanager
def counting() -> Iterator[StepCounter]:
    """A :class:`StepCounter` active for the block, ``Tensor.tolist`` counted as a host sync."""
    counter = StepCounter()
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counter.ops["<sync> Tensor.tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def fresh(batch):
    """``batch`` as it arrives from a data loader: a KeyedJaggedTensor rebuilt from its keys,
    values, lengths and weights, with none of the host-side sizes (``length_per_key``, ...)
    that another model's step on the same object cached (reading them is a host sync)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(batch, KeyedJaggedTensor) or batch.variable_stride_per_key():
        return batch  # a variable-batch KJT keeps its per-key strides as they are
    return KeyedJaggedTensor(keys=batch.keys(), values=batch.values(), lengths=batch.lengths(),
                             weights=batch.weights_or_none(), stride=batch.stride())


def count_training_step(model, batch) -> Dict[str, int]:
    """Counts of one training step of a sharded model (output ``.wait().values().sum()`` as
    the loss) on a :func:`fresh` copy of ``batch`` (so no model's count depends on which ran
    before it), forward and backward apart: ``{fwd,bwd}_{collectives,host_syncs,ops}``."""
    batch = fresh(batch)
    with counting() as fwd:
        loss = model(batch).wait().values().sum()
    with counting() as bwd:
        loss.backward()
    out = {f"fwd_{k}": v for k, v in fwd.summary().items()}
    out.update({f"bwd_{k}": v for k, v in bwd.summary().items()})
    return out
