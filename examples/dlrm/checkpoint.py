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

**Integrity.** DCP keeps no checksum, so a damaged shard would load silently. Before the
rename, the ranks hash every file of ``step_<N>.tmp`` (DCP's ``.distcp`` shards and
``.metadata``, the extra files; SHA-256, streamed, the files split between the ranks) and
rank 0 writes the digests and sizes to ``step_<N>/MANIFEST.json`` (written to a temporary
name, fsynced, renamed: the last file, published with the directory). :func:`load` verifies
every listed file first (split between the ranks, verdicts gathered), so a damaged, truncated
or missing file raises :class:`CheckpointIntegrityError` naming it on every rank, before
anything is read. A checkpoint without a manifest (written before there was one) loads with
one warning.

The frequency statistics that chose the hot set are stored beside the checkpoints
(``<dir>/stats.pt``) so a resumed run selects the same hot rows without recounting.

Optional extra files in ``step_<N>`` (``extra`` of :func:`save`; nothing in the DCP layout
depends on them, so a checkpoint with them loads into a stock plan and one without them
into a hybrid plan): ``hot_sets.pt``, the hot sets in use at step N (they may have been
refreshed since the plan chose them), and with ``checkpoint.stats`` ``refresh_stats.pt``, the
merged streaming statistics that pick the next ones (``examples/dlrm/refresh.py``).
"""

from __future__ import annotations

import hashlib
import json
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
MANIFEST = "MANIFEST.json"
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (the message names the directory or file)."""


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint file is damaged, truncated or missing (the message names it)."""
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
           with_optimizer: bool = True, fused_sd: Optional[Dict[str, Any]] = None,
           global_batch: int = 0) -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "model": model.state_dict(),
        "progress": {"step": torch.tensor(step, dtype=torch.int64),
                     "data_position": torch.tensor(data_position, dtype=torch.int64),
                     # samples per global batch (0: unknown): a resume with another world size or
                     # batch size finds its data position from the samples read, or refuses
                     "global_batch": torch.tensor(global_batch, dtype=torch.int64)},
    }
    if with_optimizer:
        state["optim"] = {"embedding": embedding_optimizer_state(opt, fused_sd), "dense": opt.dense.state_dict(),
                          "embedding_optimizer": opt.embedding_optimizer}
    return state


def file_digest(path: str) -> Dict[str, Any]:
    """``{"size", "sha256"}`` of one file, streamed in 1 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _local_pieces(value: Any) -> List[Any]:
    """``[(tag, tensor)]``: what this rank holds of one ``state_dict`` value."""
    if hasattr(value, "local_shards"):  # ShardedTensor: each local shard, named by its offsets
        return [(str(list(s.metadata.shard_offsets)), s.tensor) for s in value.local_shards()]
    if hasattr(value, "to_local"):  # DTensor
        return [("", value.to_local())]
    return [("", value)] if isinstance(value, torch.Tensor) else []


def weights_digest(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None) -> str:
    """Collective: SHA-256 of the model's weights as the ranks hold them (each rank's
    ``state_dict`` tensors and local shards, hashed bit for bit, in rank order). Two runs of
    the same config and plan that end with the same weights give the same digest."""
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        for tag, t in _local_pieces(value):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{name}{tag}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hashlib.sha256("".join(_gathered(h.hexdigest(), group)).encode()).hexdigest()


def _files(path: str) -> List[str]:
    """Every file under ``path`` (relative, sorted), the manifest and its temporary excepted."""
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


def _shared(value: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """Rank 0's ``value`` on every rank (a no-op without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _gathered(value: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    if not dist.is_initialized():
        return [value]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _my_share(items: List[str], group: Optional[dist.ProcessGroup]) -> List[str]:
    if not dist.is_initialized():
        return items
    return items[dist.get_rank(group)::dist.get_world_size(group)]


def write_manifest(path: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective: hashes every file of the checkpoint directory ``path`` (split between the
    ranks) and rank 0 writes ``MANIFEST.json`` atomically (temporary name, fsync, rename)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    names = _shared(_files(path) if rank == 0 else None, group)
    mine = {}
    for name in _my_share(names, group):
        mine[name] = file_digest(os.path.join(path, name))
    digests = {}
    for part in _gathered(mine, group):
        digests.update(part)
    if rank == 0:
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"version": 1, "algorithm": "sha256",
                       "files": {n: digests[n] for n in sorted(digests)}}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))


def _read_manifest(path: str) -> Dict[str, Any]:
    """The manifest of ``path`` (``{}`` when there is none); raises on a damaged one."""
    name = os.path.join(path, MANIFEST)
    if not os.path.exists(name):
        return {}
    try:
        with open(name) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and {"size", "sha256"} <= set(v) for v in files.values()):
            raise ValueError("'files' is not a mapping of {size, sha256}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointIntegrityError(f"checkpoint {path}: damaged manifest {name}: {e}") from None
    return manifest


def _check_file(path: str, name: str, want: Dict[str, Any]) -> Optional[str]:
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        return f"{full}: missing"
    size = os.path.getsize(full)
    if size != want["size"]:
        return f"{full}: truncated or grown ({size} bytes, {want['size']} written)"
    got = file_digest(full)["sha256"]
    if got != want["sha256"]:
        return f"{full}: damaged (sha256 {got[:16]}..., {want['sha256'][:16]}... written)"
    return None


def verify(path: str, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Collective: checks every file of checkpoint ``path`` against its manifest (the files
    split between the ranks, the verdicts gathered), so every rank raises the same
    :class:`CheckpointIntegrityError` naming each damaged, truncated or missing file. Returns
    False (rank 0 warns once) for a checkpoint without a manifest."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    found: Any = None
    if rank == 0:
        try:
            found = _read_manifest(path)
        except CheckpointIntegrityError as e:
            found = str(e)
    found = _shared(found, group)
    if isinstance(found, str):
        raise CheckpointIntegrityError(found)
    if not found:
        if rank == 0:
            logger.warning("checkpoint %s has no %s (written before checkpoints had checksums): "
                           "loading it unverified", path, MANIFEST)
        return False
    files = found["files"]
    problems = [p for name in _my_share(sorted(files), group) if (p := _check_file(path, name, files[name]))]
    problems = sorted(p for part in _gathered(problems, group) for p in part)
    if problems:
        raise CheckpointIntegrityError(
            f"checkpoint {path} failed its integrity check ({MANIFEST}), not loaded: " + "; ".join(problems))
    unlisted = sorted(set(_files(path)) - set(files))
    if unlisted and rank == 0:
        logger.warning("checkpoint %s: files not in its %s (ignored): %s", path, MANIFEST, unlisted)
    return True


def save(directory: str, step: int, model: torch.nn.Module, opt: Optimizers, data_position: int,
         group: Optional[dist.ProcessGroup] = None, keep_last: int = 0,
         extra: Optional[Dict[str, Callable[[str], None]]] = None, global_batch: int = 0) -> str:
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
    dcp.save(_state(model, opt, step, data_position, global_batch=global_batch), checkpoint_id=tmp,
             process_group=group)
    dist.barrier(group=group)  # every rank's files are written
    if rank == 0:
        for name, write in (extra or {}).items():
            write(os.path.join(tmp, name))
    dist.barrier(group=group)  # the extra files are written
    write_manifest(tmp, group)  # the last file: checksums of all the others
    if rank == 0:
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
    if not emb:  # nothing left to load (DCP refuses an empty entry)
        del optim["embedding"]
    if not saved_alg:
        del optim["embedding_optimizer"]
    dense_keys = [k for k in _flat_keys(optim["dense"], "optim.dense.") if k not in saved]
    if dense_keys:
        problems.append(f"dense optimizer state missing in the checkpoint ({len(dense_keys)} entries, e.g. "
                        f"{dense_keys[:3]}); the MLP optimizer starts fresh")
        del optim["dense"]
    return problems


def load(path: str, model: torch.nn.Module, opt: Optimizers, group: Optional[dist.ProcessGroup] = None,
         with_optimizer: bool = True, global_batch: int = 0, source: str = "synthetic") -> Dict[str, int]:
    """Collective: restores model, optimizer and progress from ``path``; returns the progress.

    The checkpoint may come from any plan. ``with_optimizer=False`` loads only weights and
    progress (the optimizer starts fresh). Every file is first checked against the manifest
    (:func:`verify`): a damaged one raises :class:`CheckpointIntegrityError` on every rank.
    """
    verify(path, group)
    fused_sd = opt.fused.state_dict() if with_optimizer else None
    state = _state(model, opt, 0, 0, with_optimizer=with_optimizer, fused_sd=fused_sd)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if "progress.global_batch" not in saved:  # written before it was recorded
        del state["progress"]["global_batch"]
    if with_optimizer:
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
    progress["data_position"] = _data_position(path, progress, global_batch, source)
    logger.info("resumed from %s (step %d, data position %d)", path, progress["step"],
                progress["data_position"])
    return progress


def _data_position(path: str, progress: Dict[str, int], global_batch: int, source: str = "criteo_tsv") -> int:
    """The next global batch to read in a run of ``global_batch`` samples per step. Synthetic
    batch i is generated for the run's own world size, so its index carries over as it is;
    Criteo TSV lines are read in order, so the position becomes the samples already read, in
    this run's batches (CheckpointError when they do not divide); ``criteo_npy`` gives each rank a
    contiguous block of every day, which another world size or batch size would reshuffle
    (CheckpointError: the run ends with one line per rank, as for any unusable checkpoint). The same
    verdict on every rank: every rank read the same progress."""
    theirs, position = progress.get("global_batch", 0), progress["data_position"]
    if not theirs or not global_batch or theirs == global_batch or source == "synthetic":
        return position
    samples = position * theirs
    if source != "criteo_tsv":
        raise CheckpointError(f"checkpoint {path} read {position} global batches of {theirs} samples from {source}, "
                              f"whose rows are split among the ranks by world size and batch size; this run's global "
                              f"batch is {global_batch}: resume with the checkpoint's world size and data.batch_size")
    if samples % global_batch:
        raise CheckpointError(f"checkpoint {path} read {samples} samples in global batches of {theirs}; this run's "
                              f"global batches of {global_batch} (data.batch_size x world size) cannot continue at "
                              "that sample: resume with a global batch that divides it, or the checkpoint's")
    return samples // global_batch
