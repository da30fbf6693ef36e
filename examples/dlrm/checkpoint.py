"""Checkpoints of the DLRM example with ``torch.distributed.checkpoint`` (DCP).

One checkpoint is a DCP directory ``<dir>/step_<N>`` holding the sharded model state
(each rank writes its own shards), the optimizer state (fused embedding optimizer + dense
optimizer) and the training progress (``step`` and ``data_position``: the next global batch
to read). Because the hybrid tables appear in ``state_dict`` as full logical tables, a
checkpoint loads into any plan (hybrid, stock, another hot set).

Loading: DCP writes into the current state_dict in place; then ``load_state_dict`` is called
on the optimizer and on the model. The hybrid tables' hot replicas need nothing: their
owners re-send them from the loaded rows in every forward.

The frequency statistics that chose the hot set are stored beside the checkpoints
(``<dir>/stats.pt``) so a resumed run selects the same hot rows without recounting.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

logger = logging.getLogger(__name__)

STATS_FILE = "stats.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step}")


def latest(directory: Optional[str]) -> Optional[str]:
    """The newest complete checkpoint under ``directory`` (DCP writes .metadata last)."""
    if not directory or not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, ".metadata")):
            found.append((int(m.group(1)), name))
    return os.path.join(directory, max(found)[1]) if found else None


def _state(model: torch.nn.Module, optimizer, step: int, data_position: int) -> Dict:
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "progress": {"step": torch.tensor(step, dtype=torch.int64),
                     "data_position": torch.tensor(data_position, dtype=torch.int64)},
    }


def save(directory: str, step: int, model: torch.nn.Module, optimizer, data_position: int,
         group: Optional[dist.ProcessGroup] = None) -> str:
    """Collective: every rank writes its shards of ``step_<step>``."""
    path = step_dir(directory, step)
    dcp.save(_state(model, optimizer, step, data_position), checkpoint_id=path, process_group=group)
    logger.info("saved checkpoint %s", path)
    return path


def load(path: str, model: torch.nn.Module, optimizer, group: Optional[dist.ProcessGroup] = None,
         with_optimizer: bool = True) -> Dict[str, int]:
    """Collective: restores model, optimizer and progress from ``path``; returns the progress.

    ``with_optimizer=False`` loads only weights and progress: the way to continue under a
    different plan (e.g. hybrid -> stock), whose optimizer state is laid out differently
    (a data-parallel table's dense optimizer state vs a fused table's, for instance).
    """
    state = _state(model, optimizer, 0, 0)
    if not with_optimizer:
        del state["optim"]
    dcp.load(state, checkpoint_id=path, process_group=group)
    if with_optimizer:
        optimizer.load_state_dict(state["optim"])
    model.load_state_dict(state["model"])
    progress = {k: int(v) for k, v in state["progress"].items()}
    logger.info("resumed from %s (step %d, data position %d)", path, progress["step"],
                progress["data_position"])
    return progress
