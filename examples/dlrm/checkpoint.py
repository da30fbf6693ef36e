"""Checkpoints of the DLRM example with ``torch.distributed.checkpoint`` (DCP).

One checkpoint is a DCP directory ``<dir>/step_<N>`` holding the sharded model state
(each rank writes its own shards), the optimizer state and the training progress (``step``
and ``data_position``: the next global batch to read).

**Any plan loads any checkpoint.** Hybrid tables appear in ``state_dict`` as full logical
tables, and the optimizer state is stored in a plan-independent layout:

- ``optim.embedding.<table>.<state>``: each table's optimizer state as a full logical tensor
  (``momentum1``: one accumulator per row for ``rowwise_adagrad``), whether the table was
  sharded (FBGEMM fused state, a ``ShardedTensor``) or data-parallel (the same algorithm as a
  torch optimizer, ``model.build_optimizer``); DCP reshards it into the new plan's layout;
- ``optim.dense``: the MLPs' optimizer (same parameters under every plan);
- ``optim.embedding_optimizer``: the algorithm's name.

A state the checkpoint lacks or holds with another shape (another optimizer, an older
layout) is not loaded: a warning names the tables, which keep their fresh state.

Writes are atomic: DCP writes ``step_<N>.tmp``, which is renamed once every rank is done, so
``latest`` never sees a partial checkpoint. ``keep_last`` older ones are removed.

The frequency statistics that chose the hot set are stored beside the checkpoints
(``<dir>/stats.pt``) so a resumed run selects the same hot rows without recounting.

Optional extra files in ``step_<N>`` (``extra`` of :func:`save`; nothing in the DCP layout
depends on them, so a checkpoint with them loads into a stock plan and one without them
into a hybrid plan): ``hot_sets.pt``, the hot sets in use at step N (they may have been
refreshed since the plan chose them), and with ``checkpoint.stats`` ``refresh_stats.pt``, the
merged streaming statistics that pick the next ones (``examples/dlrm/refresh.py``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from examples.dlrm.model import TORCH_TO_FUSED_STATE, Optimizers

logger = logging.getLogger(__name__)

STATS_FILE = "stats.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step}")


def step_of(path: str) -> int:
    """N of a ``.../step_N`` checkpoint directory."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if m is None:
        raise ValueError(f"checkpoint path {path!r} is not a step_N directory")
    return int(m.group(1))


def checkpoints(directory: Optional[str]) -> List[str]:
    """Complete checkpoints under ``directory``, oldest first."""
    if not directory or not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, ".metadata")):
            found.append((int(m.group(1)), name))
    return [os.path.join(directory, name) for _, name in sorted(found)]


def latest(directory: Optional[str]) -> Optional[str]:
    """The newest complete checkpoint under ``directory``."""
    found = checkpoints(directory)
    return found[-1] if found else None


def _table_of(param_key: str) -> str:
    # "...embedding_bags.<table>.weight"
    return param_key.rsplit(".", 2)[-2]


def embedding_optimizer_state(opt: Optimizers, fused_sd: Optional[Dict[str, Any]] = None
                              ) -> Dict[str, torch.Tensor]:
    """``{"<table>.<state>": tensor}`` of every table, whatever its sharding.

    The tensors are those of ``fused_sd`` (the fused optimizer's ``state_dict()``) and views of
    the torch optimizer's state, so DCP loads into them in place.
    """
    out: Dict[str, torch.Tensor] = {}
    fused_sd = opt.fused.state_dict() if fused_sd is None else fused_sd
    for param_key, states in fused_sd["state"].items():
        table = _table_of(param_key)
        for name, value in states.items():  # "<table>.momentum1"
            if isinstance(value, torch.Tensor):
                out[f"{table}.{name.split('.', 1)[1]}"] = value
    if opt.replicated is not None:
        rowwise = opt.embedding_optimizer == "rowwise_adagrad"
        for param_key, states in opt.replicated.state_dict()["state"].items():
            table = _table_of(param_key)
            for name, value in states.items():
                if name in TORCH_TO_FUSED_STATE:  # "sum" [rows, 1] -> "momentum1" [rows]
                    out[f"{table}.{TORCH_TO_FUSED_STATE[name]}"] = value.view(-1) if rowwise else value
    return out


def _state(model: torch.nn.Module, opt: Optimizers, step: int, data_position: int,
           with_optimizer: bool = True, fused_sd: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "model": model.state_dict(),
        "progress": {"step": torch.tensor(step, dtype=torch.int64),
                     "data_position": torch.tensor(data_position, dtype=torch.int64)},
    }
    if with_optimizer:
        state["optim"] = {"embedding": embedding_optimizer_state(opt, fused_sd), "dense": opt.dense.state_dict(),
                          "embedding_optimizer": opt.embedding_optimizer}
    return state


def save(directory: str, step: int, model: torch.nn.Module, opt: Optimizers, data_position: int,
         group: Optional[dist.ProcessGroup] = None, keep_last: int = 0,
         extra: Optional[Dict[str, Callable[[str], None]]] = None) -> str:
    """Collective: every rank writes its shards; rank 0 publishes ``step_<step>`` atomically.

    ``extra``: optional files beside the DCP shards, ``name -> writer(path)``, run by rank 0
    before the rename (the hot sets, the refresh statistics); a plan that does not use them
    ignores them, so the checkpoint still loads into any plan.
    """
    path = step_dir(directory, step)
    tmp = path + ".tmp"
    rank = dist.get_rank(group)
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier(group=group)
    dcp.save(_state(model, opt, step, data_position), checkpoint_id=tmp, process_group=group)
    dist.barrier(group=group)  # every rank's files are written
    if rank == 0:
        for name, write in (extra or {}).items():
            write(os.path.join(tmp, name))
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
        if keep_last > 0:
            for old in checkpoints(directory)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
                logger.info("removed old checkpoint %s (checkpoint.keep_last=%d)", old, keep_last)
    dist.barrier(group=group)
    logger.info("saved checkpoint %s", path)
    return path


def _flat_keys(state: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_keys(v, key + "."))
        else:
            out[key] = v
    return out


def _prune_unmappable(state: Dict[str, Any], saved: Dict[str, Any]) -> List[str]:
    """Drops from ``state["optim"]`` what the checkpoint cannot fill; returns warnings."""
    problems: List[str] = []
    optim = state["optim"]
    saved_alg = "optim.embedding_optimizer" in saved
    emb = optim["embedding"]
    missing, reshaped = [], []
    for key in list(emb):
        meta = saved.get(f"optim.embedding.{key}")
        size = getattr(meta, "size", None)
        if meta is None:
            missing.append(key)
        elif size is not None and tuple(size) != tuple(emb[key].shape):
            reshaped.append(f"{key} {tuple(size)} -> {tuple(emb[key].shape)}")
        else:
            continue
        del emb[key]
    if missing:
        tables = sorted({k.rsplit(".", 1)[0] for k in missing})
        problems.append(f"no embedding optimizer state in the checkpoint for {len(tables)} table(s) "
                        f"{tables}{'' if saved_alg else ' (a checkpoint of an older layout)'}; "
                        "they start with fresh optimizer state")
    if reshaped:
        problems.append(f"embedding optimizer state of another shape (another optimizer?) not loaded: {reshaped}")
    if not saved_alg:
        del optim["embedding_optimizer"]
    dense_keys = [k for k in _flat_keys(optim["dense"], "optim.dense.") if k not in saved]
    if dense_keys:
        problems.append(f"dense optimizer state missing in the checkpoint ({len(dense_keys)} entries, e.g. "
                        f"{dense_keys[:3]}); the MLP optimizer starts fresh")
        del optim["dense"]
    return problems


def load(path: str, model: torch.nn.Module, opt: Optimizers, group: Optional[dist.ProcessGroup] = None,
         with_optimizer: bool = True) -> Dict[str, int]:
    """Collective: restores model, optimizer and progress from ``path``; returns the progress.

    The checkpoint may come from any plan. ``with_optimizer=False`` loads only weights and
    progress (the optimizer starts fresh).
    """
    fused_sd = opt.fused.state_dict() if with_optimizer else None
    state = _state(model, opt, 0, 0, with_optimizer=with_optimizer, fused_sd=fused_sd)
    if with_optimizer:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        for problem in _prune_unmappable(state, saved):
            logger.warning("%s: %s", path, problem)
    dcp.load(state, checkpoint_id=path, process_group=group)
    if with_optimizer:
        optim = state["optim"]
        theirs = optim.get("embedding_optimizer")
        if theirs is not None and theirs != opt.embedding_optimizer:
            logger.warning("%s: embedding optimizer state of %r loaded into %r", path, theirs,
                           opt.embedding_optimizer)
        # DCP filled fused_sd's tensors; load_state_dict copies them into the kernels
        opt.fused.load_state_dict(fused_sd)
        if "dense" in optim:
            opt.dense.load_state_dict(optim["dense"])
    model.load_state_dict(state["model"])
    progress = {k: int(v) for k, v in state["progress"].items()}
    logger.info("resumed from %s (step %d, data position %d)", path, progress["step"],
                progress["data_position"])
    return progress
