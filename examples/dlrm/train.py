"""Train TorchRec's DLRM with frequency-hybrid embedding sharding (launch with torchrun).

    .venv/bin/torchrun --nproc_per_node 2 examples/dlrm/train.py --config configs/dlrm.yaml

Wiring (each piece is a small module next to this file):
  config.py      validated config schema, YAML + ``--set key=value`` / ``--steps N`` overrides
  data.py        synthetic Criteo-like batches, or Criteo TSV / .npy files
  (stats)        frequency statistics of the first N batches (all-reduced), or a file
  model.py       DLRM -> network (measured: sharding.network) -> plan (hybrid planner | manual | stock),
                 one line saying which plan and why -> DMP -> optimizers
  checkpoint.py  torch.distributed.checkpoint save / resume under any plan (model, optimizer, progress)
  metrics.py     loss, AUC and NE (torchrec.metrics), validation, samples/s, embedding bytes per step
  refresh.py     hot-set coverage per step; streaming statistics and hot-set refresh (sharding.refresh)

SIGTERM/SIGINT: every rank stops at the same step (checkpointing first, ``checkpoint.on_signal``).
Workers stop the same way when their launcher dies (at once during start-up: launcher_watch.py), and
a per-step watchdog (``dist.step_timeout_s``) turns a stuck peer into an error naming it (watchdog.py).

Rank 0 shows a tqdm bar and logs to stderr; at the end it prints ONE JSON line to stdout.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import json
import logging
import os
import signal
import sys
import warnings
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a script: make `examples.dlrm` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.dlrm import launcher_watch  # noqa: E402 - standard library only

if __name__ == "__main__" and "LOCAL_RANK" in os.environ:  # under torchrun: a launcher that dies from
    launcher_watch.watch_launcher()  # here on (imports, process group, planning) ends this worker at once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import tqdm  # noqa: E402

from examples.dlrm import checkpoint  # noqa: E402
from examples.dlrm.config import Config, ConfigError, config_from_args  # noqa: E402
from examples.dlrm.data import build_data, build_validation  # noqa: E402
from examples.dlrm.metrics import (  # noqa: E402
    JsonlLog, StepTimer, TrainMetrics, evaluate, json_safe, measure_dense_sync_bytes)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist  # noqa: E402
from examples.dlrm.model import (  # noqa: E402
    PlanResult, build_model, build_optimizer, build_plan, hot_set_rule, init_embeddings, mlp_numel, network_fields,
    plan_summary, plan_table, planned_hot_ids, replicated_tables, shard_model)
from examples.dlrm.refresh import HotSetTracker  # noqa: E402
from examples.dlrm.watchdog import StepWatchdog  # noqa: E402
from torchrec_hybrid.stats import FrequencyStats  # noqa: E402

logger = logging.getLogger("dlrm")


def setup_logging(rank: int, level: str) -> None:
    """Our loggers at ``level`` on rank 0 (WARNING elsewhere); libraries only at WARNING."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    ours = getattr(logging, level.upper()) if rank == 0 else logging.WARNING
    for name in ("dlrm", "examples.dlrm"):
        logging.getLogger(name).setLevel(ours)
    for noisy in ("torchrec", "torch.fx._symbolic_trace", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:  # torchrec warns on the root logger for DP tables
        handler.addFilter(lambda r: not r.getMessage().startswith("Sharding spec not found"))
    warnings.filterwarnings("ignore")


class StopRequest:
    """SIGTERM/SIGINT set a flag; ``agreed`` (collective) stops every rank at the same step."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self, group) -> int:
        flag = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag)


def attempt_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """The process groups' store under torchrun: this attempt's own keys in the launcher's store.

    torchrun's workers share a TCPStore held by the launcher (``TORCHELASTIC_USE_AGENT_STORE``:
    static rendezvous, and c10d / ``--standalone`` unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
    and that store outlives a restart: ``StaticTCPRendezvous`` and ``DynamicRendezvousHandler``
    (torch 2.13) create it once per launcher. ``init_process_group(env://)`` uses it without a
    per-attempt prefix, so the workers of a restart find the keys of the attempt before, gloo's
    peer addresses (``connectFullMesh``) among them: a restarted rank may connect to the dead
    worker's address ("Connection refused") or wait for a peer that connects elsewhere (a hang
    that outlasts the process-group timeout). Prefixing every key with the restart count gives
    each attempt a namespace of its own (one launcher: the same count on every worker). Returns
    None when torchrun gives no shared store (plain ``env://``: a new store every attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"dlrm/{run}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def setup_distributed(cfg: Config):
    """Process group from torchrun's environment: NCCL when CUDA is there, else gloo. Under
    torchrun each restart gets keys of its own in the launcher's store (:func:`attempt_store`)."""
    backend = cfg.dist.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def resume_point(cfg: Config, rank: int, group) -> Optional[str]:
    """The checkpoint to resume from (rank 0 looks, every rank gets its answer): the newest in
    ``checkpoint.dir`` with ``checkpoint.resume`` true (none is an error naming the directory)
    or ``auto`` (none: start fresh); None when not resuming."""
    mode = cfg.checkpoint.resume
    if not mode:
        return None
    found: List[Any] = [checkpoint.latest(cfg.checkpoint.dir) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0, group=group)
    path = found[0]
    if path is None:
        directory = cfg.checkpoint.dir
        if mode == "auto":
            logger.info("checkpoint.resume: auto and %s holds no checkpoint yet: starting fresh", directory)
            return None
        what = "does not exist" if not os.path.isdir(directory) else "holds no complete checkpoint (step_N)"
        raise checkpoint.CheckpointError(
            f"checkpoint.resume is true but checkpoint.dir {os.path.abspath(directory)!r} {what}: nothing to "
            "resume (check the path; checkpoint.resume: auto / --resume=auto starts fresh when there is none)")
    return path


def frequency_stats(cfg: Config, source, tables, rank: int, resuming: bool, group) -> Optional[FrequencyStats]:
    """Statistics for the hot set: from the checkpoint dir (resume), a file, or the first N batches."""
    sc = cfg.sharding.stats
    ckpt_dir = cfg.checkpoint.dir
    kept = os.path.join(ckpt_dir, checkpoint.STATS_FILE) if ckpt_dir else None
    if resuming and kept and os.path.exists(kept):
        logger.info("frequency statistics from %s (saved with the checkpoints)", kept)
        return FrequencyStats.load(kept, tables)
    if sc.file:
        logger.info("frequency statistics from %s", sc.file)
        stats = FrequencyStats.load(sc.file, tables)
    else:
        stats = FrequencyStats(tables)
        for batch in itertools.islice(source.batches(0), sc.batches):
            stats.update(batch.sparse_features)
        stats.all_reduce_(group)  # CPU counters: the gloo side group (also under NCCL)
        logger.info("frequency statistics from the first %d batches (%d samples, all ranks)",
                    stats.num_batches // dist.get_world_size(), stats.num_samples)
    if rank == 0:
        for path in filter(None, (sc.save, kept)):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            stats.save(path)
    return stats


def local_share(stats: FrequencyStats, hot_ids: Dict[str, torch.Tensor], replicated: List[str]) -> float:
    """Share of the counted lookups served without communication: hot rows + replicated tables."""
    hit = sum(int(stats.counts(n)[ids].sum()) for n, ids in hot_ids.items() if stats.is_exact(n))
    hit += sum(stats.lookups(n) for n in replicated)
    total = sum(stats.lookups(n) for n in stats.table_names)
    return hit / total if total else float("nan")


def validation_pass(dmp, pipeline, make_batches, cfg: Config, device, world: int, rank: int,
                    group) -> Dict[str, float]:
    """Held-out batches scored outside the pipeline (its in-flight batch is kept)."""
    n = int(cfg.metrics.validation_batches)
    batches = list(itertools.islice(make_batches(), n))
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)  # finite files: the same count everywhere
    batches = batches[: int(count)]
    model = pipeline.detach()
    try:
        return evaluate(model, batches, device, world, rank, cfg.data.batch_size, len(batches), group)
    finally:
        pipeline.attach(model)


class StepProfiler:
    """``torch.profiler`` over steps ``first .. first + count - 1``: a chrome trace per rank
    (``<dir>/trace_rank<r>.json``, open in chrome://tracing or Perfetto) showing where each
    collective starts and is waited for; no-op without a directory."""

    def __init__(self, directory: Optional[str], first: int, count: int, rank: int) -> None:
        self._dir, self._first, self._last, self._rank = directory, first, first + count - 1, rank
        self._prof: Optional[torch.profiler.profile] = None

    @contextlib.contextmanager
    def step(self, step: int):
        if self._dir and step == self._first and self._prof is None:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                                + ([torch.profiler.ProfilerActivity.CUDA]
                                                   if torch.cuda.is_available() else []))
            self._prof.__enter__()
        with torch.profiler.record_function(f"## step {step} ##") if self._prof else contextlib.nullcontext():
            yield
        if self._prof is not None and step == self._last:
            self.close()

    def close(self) -> None:
        if self._prof is None or not self._dir:
            return
        self._prof.__exit__(None, None, None)
        os.makedirs(self._dir, exist_ok=True)
        path = os.path.join(self._dir, f"trace_rank{self._rank}.json")
        self._prof.export_chrome_trace(path)
        self._prof = None
        logger.info("profiler trace of steps %d-%d: %s", self._first + 1, self._last + 1, path)


def start_process(cfg: Config):
    """Signals, the launcher watch, the process groups and logging: ``(stop, rank, world,
    device, side_group)``. ``side_group`` (gloo) carries metrics and checkpoint planning, off
    the step's process group."""
    stop = StopRequest()  # before the process group: a signal from here on stops cleanly
    rank, world, device = setup_distributed(cfg)
    setup_logging(rank, cfg.train.log_level)
    env = os.environ
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("LOCAL_WORLD_SIZE", world)) < world
            and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        logger.warning("restarts across several torchrun launchers: each counts its own restarts, so the "
                       "attempts' store keys may not match (pytorch/pytorch#135712); launch with "
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d for a new store per attempt")
    torch.set_num_threads(int(cfg.train.threads))
    side_group = dist.new_group(backend="gloo")
    logger.info("world %d, backend %s, device %s", world, dist.get_backend(), device)
    return stop, rank, world, device, side_group


class Training:
    """One run of the example: plan and shard, resume, the training loop, the final figures.

    The phases are methods; what they share (the sharded model, its optimizer, the hot-set
    tracker, the metrics) are attributes set by :meth:`prepare`.
    """

    def __init__(self, cfg: Config, rank: int, world: int, device: torch.device, side_group) -> None:
        self.cfg, self.rank, self.world, self.device, self.side_group = cfg, rank, world, device, side_group
        self.steps = int(cfg.train.steps)
        self.start = self.data_position = 0
        self.val: Dict[str, float] = {}
        self.plan_fields: Dict[str, Any] = {}  # plan_summary's fields and the network, for the final JSON

    def prepare(self, resume_from: Optional[str]) -> None:
        """Data, statistics, plan, sharded model and optimizer, hot-set tracker; then the
        checkpoint to resume from, if any."""
        cfg = self.cfg
        self.source, self.tables = build_data(cfg, self.rank, self.world)
        rule_hot_ids: Dict[str, torch.Tensor] = {}
        self.stats = None
        if cfg.sharding.planner != "stock":
            self.stats = frequency_stats(cfg, self.source, self.tables, self.rank, resuming=resume_from is not None,
                                         group=self.side_group)
            rule_hot_ids = hot_set_rule(cfg).select(self.stats)  # manual plan (the hybrid planner picks its own)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, self.tables)
        planned = build_plan(cfg, model, self.stats, rule_hot_ids, self.world, self.device, dist.group.WORLD)
        self.planner_used = planned.name
        self.hot_ids = planned_hot_ids(planned.plan, rule_hot_ids)
        self._log_plan(planned)
        self.dmp = shard_model(model, planned.plan, planned.sharder, self.device)
        init_embeddings(self.dmp, self.tables, cfg.seed)  # the same initial tables under every plan
        self.opt = build_optimizer(cfg, self.dmp)
        self.tracker = HotSetTracker(cfg, self.dmp, self.tables, self.side_group)
        if self.tracker.refreshing:
            rc = cfg.sharding.refresh
            logger.info("hot-set refresh: every %s steps, below coverage %s of the last %d steps; statistics "
                        "decay %g per batch", rc.every or "-", rc.min_coverage, rc.window, rc.decay)
        if resume_from is not None:
            progress = checkpoint.load(resume_from, self.dmp, self.opt, group=self.side_group,
                                       with_optimizer=cfg.checkpoint.load_optimizer,
                                       global_batch=cfg.data.batch_size * self.world, source=cfg.data.source)
            self.start, self.data_position = progress["step"], progress["data_position"]
            self.tracker.restore(resume_from)  # the hot sets (and statistics) in use when it was written

    def _log_plan(self, planned: PlanResult) -> None:
        """The planner's comparison and the plan's table, then one line saying which plan this run
        trains and why (:func:`plan_summary`; its fields go into the final JSON)."""
        plan, planner = planned.plan, planned.planner
        rank_bytes = planner.estimated_rank_bytes() if hasattr(planner, "estimated_rank_bytes") else None
        for line in planner.comparison_table() if hasattr(planner, "comparison_table") else []:
            logger.info("%s", line)
        for line in plan_table(plan, self.tables, self.hot_ids, self.stats, self.world,
                               self.cfg.optim.embedding.optimizer, rank_bytes):
            logger.info("plan: %s", line)
        if self.stats is not None:
            logger.info("hot set: %d rows of %d; %.1f%% of the counted lookups are local (hot rows + "
                        "data-parallel tables)", sum(int(v.numel()) for v in self.hot_ids.values()),
                        sum(t.num_embeddings for t in self.tables),
                        100 * local_share(self.stats, self.hot_ids, replicated_tables(plan)))
        line, self.plan_fields = plan_summary(planned)
        self.plan_fields["network"] = network_fields(self.cfg.sharding.network, planner is not None,
                                                     planned.measurement)
        logger.info("plan: %s", line)

    def _loop_parts(self) -> None:
        """The batches (a finite source: the same step count on every rank), the pipeline,
        validation, metrics, logs and the step watchdog."""
        cfg, world = self.cfg, self.world
        if self.source.num_batches is not None:  # finite files: every rank must run the same steps
            n = torch.tensor(self.source.num_batches - self.data_position)  # batches left to read
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.side_group)
            self.steps = min(self.steps, self.start + int(n))
        self.batches = self.tracker.wrap(itertools.islice(self.source.batches(self.data_position),
                                                          max(0, self.steps - self.start)))
        self.pipeline = TrainPipelineSparseDist(self.dmp, self.opt.combined, self.device)
        self.validation = build_validation(cfg, self.rank, world) if cfg.metrics.validation_batches else None
        if cfg.metrics.validation_batches and self.validation is None:
            logger.warning("metrics.validation_batches is set but data.source %r names no held-out data "
                           "(data.validation_paths / data.validation_dir): no validation", cfg.data.source)
        self.metrics = TrainMetrics(global_batch=world * cfg.data.batch_size, window=cfg.metrics.window,
                                    warmup_steps=cfg.metrics.warmup_steps, world_size=world, rank=self.rank,
                                    batch_size=cfg.data.batch_size,
                                    dense_sync_bytes=measure_dense_sync_bytes(mlp_numel(self.dmp), self.device),
                                    group=self.side_group)
        self.jsonl = JsonlLog(cfg.metrics.jsonl if self.rank == 0 else None,
                              resume_from=self.start if self.start > 0 else None)
        tqdm.tqdm.monitor_interval = 0  # no background thread writing inside a measured step
        self.bar = tqdm.tqdm(total=self.steps, initial=self.start, file=sys.stderr, desc="train",
                             disable=self.rank != 0 or not cfg.train.progress_bar, dynamic_ncols=True)
        self.watchdog = StepWatchdog(cfg.dist.step_timeout_s, self.rank, world)

    def save_checkpoint(self, at: int) -> None:
        cfg = self.cfg
        with self.watchdog.paused():  # the process-group timeout covers the checkpoint's collectives
            checkpoint.save(cfg.checkpoint.dir, at, self.dmp, self.opt,
                            data_position=self.data_position + at - self.start,
                            extra=self.tracker.checkpoint_files(cfg.checkpoint.stats),
                            group=self.side_group, keep_last=int(cfg.checkpoint.keep_last),
                            global_batch=cfg.data.batch_size * self.world)

    def run(self, stop: StopRequest) -> Dict[str, Any]:
        """The training loop, then the last checkpoint and validation: the final figures."""
        cfg = self.cfg
        self._loop_parts()
        stopped_by = 0
        self.dmp.train()
        step = saved_at = self.start
        profiler = StepProfiler(cfg.train.profile_dir, self.start + cfg.train.profile_after, cfg.train.profile_steps,
                                self.rank)
        self.watchdog.start(step)
        # training: a launcher that dies now stops every rank at a step boundary (SIGTERM, checkpoint first)
        launcher_watch.stop_gracefully(signal.SIGTERM, grace_s=max(60.0, cfg.dist.step_timeout_s))
        while step < self.steps:
            self.watchdog.beat(step)
            stopped_by = stop.agreed(self.side_group)
            if stopped_by:
                logger.warning("%s: every rank stops at step %d", signal.Signals(stopped_by).name, step)
                break
            try:
                with profiler.step(step), StepTimer() as t:  # nothing may print or log inside
                    loss, logits, labels = self.pipeline.progress(self.batches)
            except StopIteration:
                logger.warning("data ran out after %d steps", step)
                break
            step += 1
            self._after_step(step, self.metrics.record(loss, logits, labels, t.seconds, t.sent_bytes), t.sent_bytes)
            if cfg.checkpoint.dir and cfg.checkpoint.every and step % int(cfg.checkpoint.every) == 0:
                saved_at = step
                self.save_checkpoint(step)
        self.watchdog.stop()
        self.bar.close()
        self.jsonl.close()
        profiler.close()
        if cfg.checkpoint.dir and saved_at != step and (cfg.checkpoint.on_signal or not stopped_by):
            self.save_checkpoint(step)  # always leave a checkpoint of the last step
        if self.validation is not None and not stopped_by:
            self.val = self._validate()
            logger.info("final validation loss %.4f auc %.4f ne %.4f (%d samples)",
                        self.val["val_loss"], self.val["val_auc"], self.val["val_ne"], self.val["val_samples"])
        return self._final(step, stopped_by)

    def _validate(self) -> Dict[str, float]:
        return validation_pass(self.dmp, self.pipeline, self.validation, self.cfg, self.device, self.world,
                               self.rank, self.side_group)

    def _after_step(self, step: int, value: float, sent_bytes: int) -> None:
        """Per step, outside the measured part: logs, the progress bar, hot-set refresh and
        periodic validation."""
        cfg, bar = self.cfg, self.bar
        coverage = self.tracker.after_step()  # this step's batch: hot-set coverage (all ranks), counted
        self.jsonl.write({"step": step, "loss": value, "coverage": coverage,
                          "bytes": sent_bytes - self.metrics.dense_sync_bytes})
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
        if cfg.train.log_every and step % cfg.train.log_every == 0:
            s = self.metrics.summary(step)
            cov = self.tracker.window_coverage()
            bar.clear()
            logger.info("step %d loss %.4f auc %.4f ne %.4f samples/s %.0f embedding bytes/step %.0f coverage %s",
                        step, s["loss"], s["auc"], s["ne"], s["samples_per_s"], s["bytes_per_step"],
                        "-" if cov is None else f"{cov:.3f}")
        rec = self.tracker.maybe_refresh(step)
        if rec is not None:
            bar.clear()
            logger.info("step %d hot-set refresh (%s): %d of %d hot ids changed; merge %.1f ms %d bytes, "
                        "switch %.1f ms %d bytes (rank 0)", step, rec["reason"], rec["changed"], rec["hot_rows"],
                        1e3 * rec["merge_s"], rec["merge_bytes"], 1e3 * rec["switch_s"], rec["switch_bytes"])
        val_every = int(cfg.metrics.validation_every or 0)
        if self.validation is not None and val_every and step % val_every == 0 and step < self.steps:
            with self.watchdog.paused():
                self.val = self._validate()
            bar.clear()
            logger.info("step %d validation loss %.4f auc %.4f ne %.4f (%d samples)", step,
                        self.val["val_loss"], self.val["val_auc"], self.val["val_ne"], self.val["val_samples"])

    def _final(self, step: int, stopped_by: int) -> Dict[str, Any]:
        """The run's final JSON figures (every rank computes them; collective: the weights' digest)."""
        tracker = self.tracker
        final: Dict[str, Any] = dict(self.metrics.summary(step))
        final.update(self.val)
        final.update(tracker.summary())
        hot = tracker.hot if tracker.active else self.hot_ids
        final.update(status=f"stopped by {signal.Signals(stopped_by).name}" if stopped_by else "completed",
                     planner=self.planner_used, **self.plan_fields, world_size=self.world,
                     global_batch=self.world * self.cfg.data.batch_size,
                     hot_rows=int(sum(int(v.numel()) for v in hot.values())), start_step=self.start,
                     weights_sha256=checkpoint.weights_digest(self.dmp, self.side_group))
        return final


def train(cfg: Config) -> Optional[Dict[str, Any]]:
    stop, rank, world, device, side_group = start_process(cfg)
    steps = int(cfg.train.steps)
    resume_from = resume_point(cfg, rank, side_group)
    if resume_from is not None and checkpoint.step_of(resume_from) >= steps:
        done = checkpoint.step_of(resume_from)
        logger.warning("nothing to do: %s is at step %d and train.steps is %d (the run has finished; "
                       "raise train.steps to continue)", resume_from, done, steps)
        dist.barrier(group=side_group)
        dist.destroy_process_group()
        return {"status": "already_finished", "step": done, "start_step": done,
                "checkpoint": resume_from} if rank == 0 else None
    run: Optional[Training] = Training(cfg, rank, world, device, side_group)
    assert run is not None
    run.prepare(resume_from)
    final = run.run(stop)
    dist.barrier(group=side_group)
    dist.destroy_process_group()
    run = None  # the model, pipeline and their threads go now, not at interpreter exit
    gc.collect()
    return json_safe(final) if rank == 0 else None


def main(argv=None) -> None:
    try:
        cfg = config_from_args(argv)
        final = train(cfg)
    except (ConfigError, checkpoint.CheckpointError) as e:  # a clear line per rank, no traceback
        # one write per message: ranks share the launcher's stderr
        sys.stderr.write(f"[rank{os.environ.get('RANK', 0)}] ERROR: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        failed = True
    else:
        failed = False
    if failed:  # out of the except block: its traceback no longer holds the model and its group
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # checkpoint errors are collective verdicts: every rank
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))  # prints before torchrun ends it
            dist.destroy_process_group()
        gc.collect()  # Gloo's worker threads end with the group, before interpreter exit
        sys.exit(1)
    if final is not None:
        print(json.dumps(final, allow_nan=False), flush=True)


if __name__ == "__main__":
    main()
