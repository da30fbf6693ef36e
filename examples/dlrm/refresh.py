"""Hot sets that follow the data during training (``sharding.refresh``), and their coverage.

:class:`HotSetTracker` sits beside the train loop:

- it sees every batch the pipeline pulls (:meth:`wrap`: only a reference is kept inside the
  measured step);
- after each step (:meth:`after_step`, outside the measured window) it takes the batch that
  step trained, measures its **coverage** (share of the hybrid tables' lookups that hit the
  hot set, ``HotSetCoverage``: a few vectorised ops) and, when refreshing, counts its ids in
  a decayed ``FrequencyStats`` (``decay`` per batch; only hybrid tables are counted). One
  tiny all-reduce (gloo side group) makes the coverage global, so every rank decides alike;
- :meth:`maybe_refresh` merges the statistics (``all_reduce_``: one collective adding only
  what was counted since the last merge) and switches the hot sets
  (``torchrec_hybrid.refresh_hot_sets``: same size per table, no weights or optimizer state
  move) every ``every`` steps, or when the coverage of the last ``window`` steps dropped
  below ``min_coverage`` (at most once per ``window`` steps). Time and bytes of the merge
  and of the switch are recorded (bytes: ``/proc/self/io`` of this rank);
- checkpoints carry the current hot sets (``hot_sets.pt`` in ``step_N``; written at a refresh step,
  also the sets the next batch was already split by) and, with ``checkpoint.stats``, the merged
  statistics (``refresh_stats.pt``); :meth:`restore` applies them after a resume to the tables that
  are hybrid in the new plan, so the resumed run splits every batch as the uninterrupted one did and
  trains bit for bit like it.

Counting uses the batch that was *trained* at each step (never the pipeline's look-ahead),
so the statistics after step ``s`` hold exactly batches ``0 .. s-1``, also after a resume.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_hybrid import HybridShardedEmbeddingBagCollection, refresh_hot_sets
from torchrec_hybrid.comm_bytes import count_sent_bytes
from torchrec_hybrid.stats import FrequencyStats, HotSetCoverage

logger = logging.getLogger(__name__)

HOT_SETS_FILE = "hot_sets.pt"
STATS_FILE = "refresh_stats.pt"


def current_hot_ids(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Sorted hot ids of every frequency_hybrid table of ``model`` (empty: none)."""
    out: Dict[str, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, HybridShardedEmbeddingBagCollection):
            out.update(m.hot_ids())
    return out


def load_hot_sets(path: str, in_flight: bool = False) -> Optional[Dict[str, torch.Tensor]]:
    """The hot sets stored in checkpoint ``path`` (None: the checkpoint has none); ``in_flight``: the sets
    the next batch was split by, stored when a refresh at that step changed them after (else None)."""
    f = os.path.join(path, HOT_SETS_FILE)
    if not os.path.exists(f):
        return None
    state = torch.load(f, map_location="cpu", weights_only=True)
    ids = state.get("in_flight") if in_flight else state["hot_ids"]
    return None if ids is None else {k: v.to(torch.int64) for k, v in ids.items()}


class HotSetTracker:
    """Coverage per step, streaming statistics and hot-set refresh of a sharded model."""

    def __init__(self, cfg, model: torch.nn.Module, tables, group: Optional[dist.ProcessGroup]) -> None:
        rc = cfg.sharding.refresh
        self.model, self.group = model, group
        self.every, self.min_coverage, self.window = int(rc.every), rc.min_coverage, int(rc.window)
        self.decay = float(rc.decay)
        self.hot = current_hot_ids(model)
        self.active = bool(self.hot)  # any hybrid table: coverage is measured
        self.refreshing = self.active and bool(self.every or self.min_coverage is not None)
        if (rc.every or rc.min_coverage is not None) and not self.active:
            (logger.info if cfg.sharding.planner == "stock" else logger.warning)(
                "sharding.refresh is set but the plan has no frequency_hybrid table: nothing to refresh")
        self.tables = [t for t in tables if t.name in self.hot]
        self.stats: Optional[FrequencyStats] = (FrequencyStats(self.tables, decay=self.decay)
                                                if self.refreshing else None)
        self._checked = False
        self.meter: Optional[HotSetCoverage] = HotSetCoverage(self.tables, self.hot) if self.active else None
        self._pending: Deque[Any] = collections.deque()
        # TrainPipelineSparseDist starts the input dist of the batch trained at step t during
        # step t-1 (both in the first step): the meters of the hot sets in effect at the start
        # of the previous and of the current step
        self._split_by: Deque[Optional[HotSetCoverage]] = collections.deque([self.meter, self.meter])
        self._recent: Deque[Tuple[float, float]] = collections.deque(maxlen=self.window)
        self._log_window: Deque[Tuple[float, float]] = collections.deque(maxlen=int(cfg.metrics.window))
        self.since_refresh = 0
        self.records: List[Dict[str, Any]] = []
        # the hot sets the batch queued for the next step was split by, when a refresh changed them after
        # that split (None: the current ones): a checkpoint keeps them, so a resume splits that batch alike
        self._in_flight: Optional[Dict[str, torch.Tensor]] = None
        self._switch_to: Optional[Dict[str, torch.Tensor]] = None  # after a resume: the sets from batch 2 on

    # -- per step --------------------------------------------------------------------
    def wrap(self, batches: Iterable[Any]) -> Iterator[Any]:
        """The batches, remembering each one (and the hot set it will be split by). After a resume at a
        refresh step, the pipeline pulls the second batch once the first is split (by the hot sets in effect
        before that refresh, as in the uninterrupted run): the refreshed sets take over there."""
        for i, b in enumerate(batches):
            if i == 1 and self._switch_to is not None:  # collective: every rank's pipeline pulls it alike
                refresh_hot_sets(self.model, hot_ids=self._switch_to)
                self._switch_to = None
                self._set_hot(current_hot_ids(self.model))
            if self.active:
                self._pending.append(b.sparse_features)
            yield b

    def after_step(self) -> Optional[float]:
        """Coverage (all ranks) of the batch the last step trained; counts it. Collective."""
        self._in_flight = None  # the batch queued now was split by the current sets
        if not self.active or not self._pending:
            return None
        kjt, meter = self._pending.popleft(), self._split_by.popleft()
        self._split_by.append(self.meter)  # for the batch after next (after a refresh: replaced)
        assert meter is not None
        hits, lookups = meter.counts(kjt)
        if self.stats is not None:
            self.stats.update(kjt)
        both = torch.tensor([float(hits.sum()), float(lookups.sum())], dtype=torch.float64)
        dist.all_reduce(both, group=self.group)
        h, n = both.tolist()
        self._recent.append((h, n))
        self._log_window.append((h, n))
        self.since_refresh += 1
        return h / n if n else None

    @staticmethod
    def _share(window: Iterable[Tuple[float, float]]) -> Optional[float]:
        h = n = 0.0
        for a, b in window:
            h, n = h + a, n + b
        return h / n if n else None

    def window_coverage(self) -> Optional[float]:
        """Coverage over the last ``metrics.window`` steps (all ranks)."""
        return self._share(self._log_window)

    def maybe_refresh(self, step: int) -> Optional[Dict[str, Any]]:
        """Merges and refreshes when due (the same decision on every rank). Collective."""
        if not self.refreshing:
            return None
        reason = None
        if self.every and step % self.every == 0:
            reason = f"every {self.every} steps"
        elif self.min_coverage is not None and self.since_refresh >= self.window:
            cov = self._share(self._recent)
            if cov is not None and cov < self.min_coverage:
                reason = f"coverage {cov:.3f} of the last {self.window} steps < {self.min_coverage}"
        if reason is None:
            return None
        rec = self.refresh(step)
        rec["reason"] = reason
        return rec

    def merge(self) -> Tuple[float, int]:
        """Merges the statistics of all ranks (one all-reduce); (seconds, bytes this rank sent)."""
        assert self.stats is not None
        t0 = time.perf_counter()
        with count_sent_bytes() as sent:
            self.stats.all_reduce_(self.group, check=not self._checked)
        self._checked = True
        return time.perf_counter() - t0, sent[0]

    def refresh(self, step: int) -> Dict[str, Any]:
        before = self.hot
        merge_s, merge_bytes = self.merge()
        assert self.stats is not None
        t0 = time.perf_counter()
        with count_sent_bytes() as sent:
            changed = refresh_hot_sets(self.model, stats=self.stats)
        switch_s = time.perf_counter() - t0
        self._set_hot(current_hot_ids(self.model))
        self._in_flight = before
        rec = {"step": step, "changed": int(sum(changed.values())),
               "hot_rows": int(sum(int(v.numel()) for v in self.hot.values())),
               "merge_s": merge_s, "merge_bytes": int(merge_bytes), "switch_s": switch_s,
               "switch_bytes": int(sent[0]), "refresh_s": merge_s + switch_s,
               "refresh_bytes": int(merge_bytes + sent[0])}
        self.records.append(rec)
        return rec

    def _set_hot(self, hot: Dict[str, torch.Tensor]) -> None:
        self.hot = hot
        self.meter = HotSetCoverage(self.tables, hot)
        if self._split_by:
            self._split_by[-1] = self.meter  # the next step starts the next batch's input dist with it
        self.since_refresh = 0
        self._recent.clear()

    # -- checkpoints -----------------------------------------------------------------
    def checkpoint_files(self, with_stats: bool) -> Dict[str, Any]:
        """Files for ``checkpoint.save(extra=...)``: name -> writer(path) run by rank 0.

        Collective when ``with_stats`` and the statistics are not merged (merges them first,
        so the file holds every rank's counts and loads as merged).
        """
        if not self.active:
            return {}
        saved: Dict[str, Any] = {"format": 1, "hot_ids": {k: v.clone() for k, v in self.hot.items()}}
        if self._in_flight is not None:  # a refresh at this step, after the next batch was split
            saved["in_flight"] = {k: v.clone() for k, v in self._in_flight.items()}
        files: Dict[str, Any] = {HOT_SETS_FILE: lambda p: torch.save(saved, p)}
        if with_stats and self.stats is not None:
            if not self.stats.is_merged:
                self.merge()
            stats = self.stats
            files[STATS_FILE] = stats.save
        return files

    def restore(self, path: str) -> None:
        """After a resume: the checkpoint's hot sets for the tables hybrid in this plan, and its
        statistics when it has them. Collective (``refresh_hot_sets``)."""
        if not self.active:
            return
        saved = load_hot_sets(path)
        if saved is None:
            logger.info("%s has no hot sets (a checkpoint of another plan or an older one): keeping the "
                        "planned ones", path)
        else:
            mine = {n: ids for n, ids in saved.items() if n in self.hot}
            resized = sorted(n for n, ids in mine.items() if ids.numel() != self.hot[n].numel())
            if resized:
                logger.info("hot sets of %s restored with their saved size (this plan sized them differently)",
                            resized)
            in_flight = load_hot_sets(path, in_flight=True)
            first = {n: in_flight.get(n, ids) for n, ids in mine.items()} if in_flight else mine
            differ = sum(int((~torch.isin(ids, self.hot[n])).sum()) for n, ids in mine.items())
            refresh_hot_sets(self.model, hot_ids=first)
            self._set_hot(current_hot_ids(self.model))
            # before training starts both queued batches are split by the restored sets, not only the second
            self._split_by = collections.deque([self.meter, self.meter])
            if in_flight:  # written at a refresh step: the first batch is split as before that refresh
                self._switch_to = mine
            logger.info("hot sets of %d hybrid table(s) from %s (%d ids differ from the planned ones)%s",
                        len(mine), os.path.join(path, HOT_SETS_FILE), differ,
                        "; the first batch is split by the sets before the refresh at that step, as in the "
                        "uninterrupted run" if in_flight else "")
        f = os.path.join(path, STATS_FILE)
        if self.stats is not None and os.path.exists(f):
            try:
                stats = FrequencyStats.load(f, self.tables)
            except ValueError as e:
                logger.warning("%s: not used (%s); refresh statistics start empty", f, e)
            else:
                stats.decay = self.decay
                self.stats = stats
                self._checked = False
                logger.info("refresh statistics from %s", f)

    def summary(self) -> Dict[str, Any]:
        n = len(self.records)
        out: Dict[str, Any] = {"coverage": self.window_coverage(), "refreshes": n}
        if n:
            out.update(refresh_s=sum(r["refresh_s"] for r in self.records) / n,
                       refresh_bytes=sum(r["refresh_bytes"] for r in self.records) / n,
                       merge_bytes=sum(r["merge_bytes"] for r in self.records) / n,
                       hot_ids_changed=sum(r["changed"] for r in self.records))
        return out
