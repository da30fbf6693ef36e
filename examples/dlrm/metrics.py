"""Training metrics of the DLRM example: loss, AUC, samples/s and bytes sent per step.

- AUC is progressive validation: each batch's logits are computed before the model trains
  on that batch, so the AUC over the last ``auc_window`` steps is an out-of-sample estimate
  (the synthetic stream never repeats a batch). Predictions of all ranks are gathered when
  a summary is taken, never inside a step.
- Bytes: ``torchrec_hybrid.comm_bytes.count_sent_bytes`` around each ``pipeline.progress``
  call (the caller measures; nothing prints inside the window). A step also all-reduces the
  MLP gradients (DDP); that part is measured once at start-up with an all-reduce of the
  same size (``measure_dense_sync_bytes``) and subtracted, so ``bytes_per_step`` is the
  embedding traffic per rank: input/output dists, hot-row sync, id checks, and the DDP
  all-reduce of data-parallel tables. ``total_bytes_per_step`` is the unadjusted figure.
- samples/s counts global samples (all ranks) after ``warmup_steps``.
"""

from __future__ import annotations

import collections
import json
import math
import time
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_hybrid.comm_bytes import count_sent_bytes


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties), vectorised."""
    scores = scores.reshape(-1).double()
    labels = labels.reshape(-1).double()
    n_pos = float(labels.sum())
    n_neg = float(labels.numel()) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each group's last element
    avg_rank = ends - (counts.double() - 1.0) / 2.0
    rank_sum_pos = float((avg_rank[inverse] * labels).sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


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

    def __init__(self, global_batch: int, auc_window: int, warmup_steps: int,
                 dense_sync_bytes: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
        self.global_batch, self.warmup_steps = global_batch, warmup_steps
        self.dense_sync_bytes = dense_sync_bytes
        self.group = group
        self.window: Deque[Tuple[float, torch.Tensor, torch.Tensor]] = collections.deque(maxlen=auc_window)
        self.steps_seen = 0
        self.timed_steps = 0
        self.timed_s = 0.0
        self.bytes_total = 0
        self.bytes_steps = 0

    def record(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, seconds: float,
               sent_bytes: int) -> float:
        """Stores one step; returns its (local) loss."""
        value = float(loss)
        self.window.append((value, logits.detach().float().cpu(), labels.detach().float().cpu()))
        self.steps_seen += 1
        if self.steps_seen > self.warmup_steps:
            self.timed_steps += 1
            self.timed_s += seconds
            self.bytes_total += sent_bytes
            self.bytes_steps += 1
        return value

    def summary(self, step: int) -> Dict[str, float]:
        """Loss/AUC over the window on all ranks, throughput and bytes (means over ranks)."""
        if not self.window:
            local = {"loss_sum": 0.0, "n": 0, "scores": torch.empty(0), "labels": torch.empty(0)}
        else:
            local = {"loss_sum": sum(w[0] for w in self.window), "n": len(self.window),
                     "scores": torch.cat([w[1] for w in self.window]),
                     "labels": torch.cat([w[2] for w in self.window])}
        local.update(timed_s=self.timed_s, timed_steps=self.timed_steps,
                     bytes=self.bytes_total, bytes_steps=self.bytes_steps)
        gathered: List[dict] = [None] * dist.get_world_size(self.group)  # type: ignore[list-item]
        dist.all_gather_object(gathered, local, group=self.group)
        n = sum(g["n"] for g in gathered)
        loss = sum(g["loss_sum"] for g in gathered) / n if n else float("nan")
        scores = torch.cat([g["scores"] for g in gathered])
        labels = torch.cat([g["labels"] for g in gathered])
        slowest = max(g["timed_s"] for g in gathered)  # ranks step together; take the slowest clock
        timed = gathered[0]["timed_steps"]
        per_rank_bytes = [g["bytes"] / g["bytes_steps"] for g in gathered if g["bytes_steps"]]
        total_bytes = sum(per_rank_bytes) / len(per_rank_bytes) if per_rank_bytes else float("nan")
        return {
            "step": step,
            "loss": loss,
            "auc": auc(scores, labels) if scores.numel() else float("nan"),
            "samples_per_s": timed * self.global_batch / slowest if slowest > 0 else float("nan"),
            "bytes_per_step": total_bytes - self.dense_sync_bytes,
            "total_bytes_per_step": total_bytes,
            "dense_bytes_per_step": float(self.dense_sync_bytes),
        }


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
    """Per-step losses to a JSON-lines file (rank 0; written outside the measured window)."""

    def __init__(self, path: Optional[str], append: bool) -> None:
        self._f = open(path, "a" if append else "w") if path else None

    def write(self, record: Dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()


def finite(d: Dict[str, float]) -> bool:
    return all(math.isfinite(float(v)) for v in d.values())
