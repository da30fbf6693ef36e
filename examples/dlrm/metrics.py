"""Metrics of the DLRM example: loss, AUC and NE (``torchrec.metrics``), samples/s, bytes/step.

- AUC and NE come from ``torchrec.metrics`` (``AUCMetric``, ``NEMetric``), one task
  ``ctr``, each over a window of the last ``metrics.window`` steps of all ranks. The
  training window is progressive validation: each batch's logits are computed before the
  model trains on that batch (the synthetic stream never repeats a batch). The metric
  states are synchronised across ranks when a summary is taken, never inside a step.
- Validation (``Evaluator``): held-out batches scored with the model in eval mode, no
  update; AUC/NE over all of them on all ranks.
- Bytes: ``torchrec_hybrid.comm_bytes.count_sent_bytes`` around each ``pipeline.progress``
  call (the caller measures; nothing prints inside the window). A step also all-reduces the
  MLP gradients (DDP); that part is measured once at start-up with an all-reduce of the
  same size (``measure_dense_sync_bytes``) and subtracted, so ``bytes_per_step`` is the
  embedding traffic per rank: input/output dists, hot-row sync, id checks, and the DDP
  all-reduce of data-parallel tables. ``total_bytes_per_step`` is the unadjusted figure.
- samples/s counts global samples (all ranks) after ``warmup_steps``; a run no longer than
  its warm-up times all its steps instead (``timed_steps`` says how many were timed).
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from typing import Any, Deque, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torchrec.metrics.auc import AUCMetric
from torchrec.metrics.ne import NEMetric
from torchrec.metrics.rec_metric import RecTaskInfo

from torchrec_hybrid.comm_bytes import count_sent_bytes

TASK = RecTaskInfo(name="ctr", label_name="label", prediction_name="prediction", weight_name="weight")


class AucNe:
    """``torchrec.metrics`` AUC and NE of one task over a window of ``window_samples``
    global samples (collective ``compute``: every rank of ``group`` calls it)."""

    def __init__(self, world_size: int, rank: int, batch_size: int, window_samples: int,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        window = max(int(window_samples), batch_size * world_size)  # torchrec: local window >= batch
        kw: Dict[str, Any] = dict(world_size=world_size, my_rank=rank, batch_size=batch_size, tasks=[TASK],
                                  window_size=window, process_group=group, compute_on_all_ranks=True)
        self.auc, self.ne = AUCMetric(**kw), NEMetric(**kw)
        self.group = group
        self.samples = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        preds = torch.sigmoid(logits.detach().float().reshape(-1)).cpu()
        labels = labels.detach().float().reshape(-1).cpu()
        kw = dict(predictions={TASK.name: preds}, labels={TASK.name: labels},
                  weights={TASK.name: torch.ones_like(preds)})
        self.auc.update(**kw)
        self.ne.update(**kw)
        self.samples += preds.numel()

    def compute(self) -> Dict[str, float]:
        """``{"auc", "ne"}`` over the window (NaN when no rank saw a sample)."""
        seen = torch.tensor([float(self.samples)])
        dist.all_reduce(seen, group=self.group)
        if float(seen) == 0:
            return {"auc": float("nan"), "ne": float("nan")}
        out = {**self.auc.compute(), **self.ne.compute()}
        return {"auc": float(out[f"auc-{TASK.name}|window_auc"]), "ne": float(out[f"ne-{TASK.name}|window_ne"])}


def measure_dense_sync_bytes(numel: int, device: torch.device, repeats: int = 3) -> int:
    """Bytes this rank sends to all-reduce ``numel`` fp32 values (what DDP does per step)."""
    buf = torch.zeros(numel, dtype=torch.float32, device=device)
    best: Optional[int] = None
    for _ in range(repeats):
        dist.barrier()
        with count_sent_bytes() as n:
            dist.all_reduce(buf)
        best = n[0] if best is None else min(best, n[0])
    return int(best or 0)


class TrainMetrics:
    """Per-step records and windowed summaries (collective: every rank calls ``summary``)."""

    def __init__(self, global_batch: int, window: int, warmup_steps: int, world_size: int, rank: int,
                 batch_size: int, dense_sync_bytes: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
        self.global_batch, self.warmup_steps = global_batch, warmup_steps
        self.dense_sync_bytes = dense_sync_bytes
        self.group = group
        self.losses: Deque[float] = collections.deque(maxlen=window)
        self.quality = AucNe(world_size, rank, batch_size, window * global_batch, group)
        self.steps_seen = 0
        self.timed = [0, 0.0, 0]  # steps, seconds, bytes after warm-up
        self.all = [0, 0.0, 0]    # the same over every step

    def record(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, seconds: float,
               sent_bytes: int) -> float:
        """Stores one step; returns its (local) loss."""
        value = float(loss)
        self.losses.append(value)
        self.quality.update(logits, labels)
        self.steps_seen += 1
        buckets = (self.all, self.timed) if self.steps_seen > self.warmup_steps else (self.all,)
        for b in buckets:
            b[0] += 1
            b[1] += seconds
            b[2] += sent_bytes
        return value

    def summary(self, step: int) -> Dict[str, float]:
        """Loss/AUC/NE over the window on all ranks, throughput and bytes (means over ranks)."""
        steps, seconds, sent = self.timed if self.timed[0] else self.all
        local = torch.tensor([sum(self.losses), len(self.losses), float(sent), float(steps)], dtype=torch.float64)
        clock = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(local, group=self.group)
        dist.all_reduce(clock, op=dist.ReduceOp.MAX, group=self.group)  # ranks step together: slowest clock
        world = dist.get_world_size(self.group)
        loss_sum, n, sent_sum, steps_sum = local.tolist()
        steps = int(steps_sum) // world
        total_bytes = sent_sum / steps_sum if steps_sum else float("nan")
        slowest = float(clock)
        q = self.quality.compute()
        return {
            "step": step,
            "loss": loss_sum / n if n else float("nan"),
            "auc": q["auc"],
            "ne": q["ne"],
            "samples_per_s": steps * self.global_batch / slowest if slowest > 0 else float("nan"),
            "timed_steps": steps,
            "bytes_per_step": total_bytes - self.dense_sync_bytes,
            "total_bytes_per_step": total_bytes,
            "dense_bytes_per_step": float(self.dense_sync_bytes),
        }


def evaluate(model: torch.nn.Module, batches: Iterable[Any], device: torch.device, world_size: int, rank: int,
             batch_size: int, num_batches: int, group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
    """Validation pass (collective): loss, AUC and NE of ``model`` over held-out ``batches``.

    ``model`` is the DMP-wrapped ``DLRMTrain``; every rank must run the same number of
    batches (the caller slices them). The model is put back in train mode afterwards.
    """
    quality = AucNe(world_size, rank, batch_size, max(1, num_batches) * batch_size * world_size, group)
    loss_sum, n = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            loss, (_, logits, labels) = model(batch)
            loss_sum += float(loss)
            n += 1
            quality.update(logits, labels)
    model.train(was_training)
    t = torch.tensor([loss_sum, float(n)], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    q = quality.compute()
    return {"val_loss": float(t[0] / t[1]) if float(t[1]) else float("nan"), "val_auc": q["auc"],
            "val_ne": q["ne"], "val_samples": int(float(t[1])) * batch_size}


class StepTimer:
    """``with timer: step()`` measures wall time and bytes sent inside the block."""

    def __enter__(self) -> "StepTimer":
        self._bytes = count_sent_bytes()
        self._box = self._bytes.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self._bytes.__exit__(*exc)
        self.sent_bytes = self._box[0]


class JsonlLog:
    """Per-step losses to a JSON-lines file (rank 0; written outside the measured window).

    ``resume_from``: the step a resumed run starts after (None: a fresh file). The file keeps its
    records up to that step and drops later ones - a run that resumes from an older checkpoint than
    its last step (a crash) trains those steps again, and would otherwise log them twice."""

    def __init__(self, path: Optional[str], resume_from: Optional[int] = None) -> None:
        kept: List[str] = []
        if path and resume_from is not None and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        step = json.loads(line).get("step")
                    except (ValueError, AttributeError):
                        continue  # a line cut short by the crash
                    if isinstance(step, int) and step <= resume_from:
                        kept.append(line if line.endswith("\n") else line + "\n")
        self._f = open(path, "w") if path else None
        if self._f and kept:
            self._f.writelines(kept)
            self._f.flush()

    def write(self, record: Dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


def finite(d: Dict[str, Any]) -> bool:
    return all(math.isfinite(float(v)) for v in d.values() if isinstance(v, (int, float)))


def json_safe(d: Dict[str, Any]) -> Dict[str, Any]:
    """NaN/inf -> None, so the JSON line is valid JSON (``null``)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
