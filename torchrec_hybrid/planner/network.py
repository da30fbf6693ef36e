"""``measure_network``: the bandwidth and fixed cost of a process group's collectives, measured.

The planner prices bytes at its topology's bandwidths (bytes/ms per rank, TorchRec's unit), which
were guesses until measured (``gloo_topology``'s 1 GiB/s; TorchRec's NVLink + NIC defaults).
``measure_network`` times ``all_to_all_single`` and ``all_reduce`` of a few sizes on the group a
plan is for, every rank sending at once as in training, and fits ``time = collective_ms + bytes /
bandwidth``; :class:`NetworkMeasurement` turns the fit into a ``Topology`` (or a copy of one with
the measured bandwidths) that this package's planner and TorchRec's own can plan with.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.planner.types import CollectiveType, GeneralizedCommsBandwidth, Topology

from torchrec_hybrid import _compat
from torchrec_hybrid.planner.topology import GB, UniformCommsBandwidth
from torchrec_hybrid.types import collective_device

logger = logging.getLogger(__name__)

# per-rank buffer sizes tried, smallest first: 4 KiB .. 16 MiB (fewer where the collective is slow)
DEFAULT_SIZES = tuple(4096 * 4 ** k for k in range(7))
DEFAULT_REPEATS = 5
# a size whose collective takes this long is measured well (its fixed cost and jitter, a few ms
# where ranks share cores, are small beside its bytes): larger ones are not tried
LONG_ENOUGH_S = 0.03
MIN_SIZES = 3  # sizes per collective for a fit, whatever the budget
# a one-rank group sends nothing: TorchRec divides by its bandwidths, so a large finite one (1 PB/s)
ONE_RANK_BANDWIDTH = 1e12
ALL_TO_ALL, ALL_REDUCE = "all_to_all", "all_reduce"


def _positive_finite(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


class MeasuredCommsBandwidth(GeneralizedCommsBandwidth):
    """Measured bandwidths (bytes/ms per rank) for a network whose all-reduce runs at its own rate
    (NCCL: rings and trees over NVLink / the NICs); reduce-scatter and all-gather move (W-1)/W of
    each rank's buffer, as an all-to-all does, so they get the all-to-all's."""

    def __init__(self, all_to_all: float, all_reduce: float) -> None:
        for name, bw in (("all_to_all", all_to_all), ("all_reduce", all_reduce)):
            if not _positive_finite(bw):
                raise ValueError(f"{name} bandwidth must be a finite number of bytes/ms > 0, got {bw!r}")
        self.name = "MeasuredCommsBandwidth"
        self._a2a, self._all_reduce = float(all_to_all), float(all_reduce)

    @property
    def intra_host_bw(self) -> float:
        return self._a2a

    @property
    def inter_host_bw(self) -> float:
        return self._a2a

    def get_bw(self, local_world_size: int, world_size: int, collective_type: CollectiveType) -> float:
        return self._all_reduce if collective_type == CollectiveType.ALL_REDUCE else self._a2a

    def __str__(self) -> str:
        return f"{self.name}: all_to_all={self._a2a}, all_reduce={self._all_reduce}"

    def __hash__(self) -> int:
        return hash((self.name, self._a2a, self._all_reduce))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MeasuredCommsBandwidth) and other._a2a == self._a2a
                and other._all_reduce == self._all_reduce)


@dataclass(frozen=True)
class NetworkMeasurement:
    """What :func:`measure_network` found on a process group (every rank holds the same one).

    Bandwidths are bytes/ms per rank, the unit of TorchRec's planner: ``bandwidth`` is the rate at
    which one rank's all-to-all bytes (those it sends the other ranks) move while every rank sends at
    once, so ``world_size * bandwidth`` is the aggregate the network carries; ``allreduce_bandwidth``
    is each rank's all-reduced buffer per ms (TorchRec's data-parallel estimate divides the buffer
    by it). ``collective_ms``: the fixed cost of one collective (the fit's intercept). The samples:
    (bytes, slowest rank's median seconds) per size - all-to-all: bytes one rank sends the others;
    all-reduce: its buffer. ``elapsed_s``: how long the measurement took.
    """

    world_size: int
    bandwidth: float
    allreduce_bandwidth: float
    collective_ms: float
    backend: str
    all_to_all_samples: Tuple[Tuple[int, float], ...] = ()
    all_reduce_samples: Tuple[Tuple[int, float], ...] = ()
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        for name in ("bandwidth", "allreduce_bandwidth"):
            if not _positive_finite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of bytes/ms > 0, got {getattr(self, name)!r}")
        ms = self.collective_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"collective_ms must be a finite number of ms >= 0, got {ms!r}")

    @property
    def bandwidth_gbps(self) -> float:
        """The per-rank all-to-all bandwidth in GiB/s, the unit ``gloo_topology`` takes."""
        return self.bandwidth * 1000.0 / GB

    def comms_bandwidths(self) -> GeneralizedCommsBandwidth:
        """The measured bandwidths as TorchRec reads them: on gloo every collective goes through the same
        TCP sockets, one bandwidth for all (``UniformCommsBandwidth``, as ``gloo_topology``); on other
        backends all-reduce gets its own (:class:`MeasuredCommsBandwidth`)."""
        if self.backend == "gloo":
            return UniformCommsBandwidth(self.bandwidth)
        return MeasuredCommsBandwidth(self.bandwidth, self.allreduce_bandwidth)

    def topology(self, compute_device: str = "cpu", **kwargs) -> Topology:
        """A ``Topology`` of the measured ranks whose comms bandwidths are the measured ones;
        ``kwargs``: Topology's other arguments (local_world_size, hbm_cap, ddr_cap, ...)."""
        return Topology(world_size=self.world_size, compute_device=compute_device,
                        generalized_comms_bandwidths=self.comms_bandwidths(), **kwargs)

    def apply_to(self, topology: Topology) -> Topology:
        """A copy of ``topology`` (every other field kept: devices and their memory, local world size,
        ...) with the measured comms bandwidths: e.g. for TorchRec's own ``EmbeddingShardingPlanner``,
        to plan for the same network as the hybrid planner."""
        if topology.world_size != self.world_size:
            raise ValueError(f"the network was measured on {self.world_size} ranks, the topology has world_size "
                             f"{topology.world_size}: measure on the group the plan is for")
        return _compat.topology_with_comms_bandwidths(copy.deepcopy(topology), self.comms_bandwidths())

    def __str__(self) -> str:
        return (f"network ({self.backend}, {self.world_size} ranks): all-to-all {self.bandwidth / 1e3:.1f} MB/s per "
                f"rank ({self.bandwidth * self.world_size / 1e3:.0f} MB/s aggregate), all-reduce "
                f"{self.allreduce_bandwidth / 1e3:.1f} MB/s of buffer per rank, {self.collective_ms:.2f} ms per "
                f"collective (measured in {self.elapsed_s:.2f} s)")


def fit_line(samples: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(collective_ms, bytes per ms)`` of ``seconds = collective_ms / 1e3 + bytes / (1e3 * bandwidth)``
    by ordinary least squares over ``(bytes, seconds)`` samples: a collective's jitter (scheduling,
    the barrier's skew) is about the same whatever its size, so every point weighs the same, the
    largest sizes pin the slope and the cluster of small ones the intercept. The intercept is
    clamped at 0, the slope kept (a token bucket's or a switch buffer's burst makes it negative); a
    slope that is not positive (times that do not grow with the bytes) gives the largest sample's
    bytes over its whole time."""
    if not samples:
        raise ValueError("fit_line needs at least one (bytes, seconds) sample, got none")
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    mt = sum(t for _, t in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    b = sum((x - mx) * (t - mt) for x, t in samples) / sxx if sxx > 0 else 0.0
    if not (b > 0 and math.isfinite(b)):
        x, t = max(samples)
        return 0.0, max(x, 1.0) / max(t * 1e3, 1e-9)
    return max(mt - b * mx, 0.0) * 1e3, 1.0 / (b * 1e3)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(op: str, nbytes: int, repeats: int, pg: dist.ProcessGroup, dev: torch.device) -> Tuple[int, List[float]]:
    """This rank's seconds for ``repeats`` runs of ``op`` on a float32 buffer of about ``nbytes`` (a
    multiple of the group's size), each behind a barrier (a one-element all-reduce: works on every
    backend, and on CUDA it is synchronised like the timed collective); returns the buffer's bytes too."""
    world = dist.get_world_size(pg)
    n = max(1, nbytes // (4 * world)) * world
    buf = torch.zeros(n, dtype=torch.float32, device=dev)  # zeros: an all-reduce leaves it zeros
    out = torch.empty_like(buf)
    flag = torch.zeros(1, dtype=torch.float32, device=dev)
    times = []
    for _ in range(repeats):
        dist.all_reduce(flag, group=pg)
        _sync(dev)
        t0 = time.perf_counter()
        if op == ALL_TO_ALL:
            dist.all_to_all_single(out, buf, group=pg)
        else:
            dist.all_reduce(buf, group=pg)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return 4 * n, times


def _check_args(sizes: Sequence[int], repeats: int, time_budget_s: float) -> None:
    if (not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            or list(sizes) != sorted(sizes)):
        raise ValueError(f"sizes must be a non-empty, increasing list of bytes per rank >= 1, got {sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not _positive_finite(time_budget_s):
        raise ValueError(f"time_budget_s must be a finite number of seconds > 0, got {time_budget_s!r}")


def measure_network(pg: Optional[dist.ProcessGroup] = None, sizes: Optional[Sequence[int]] = None,
                    repeats: int = DEFAULT_REPEATS, time_budget_s: float = 1.0) -> NetworkMeasurement:
    """Measure the all-to-all and all-reduce of ``pg`` (default: the default group); collective: every
    rank of ``pg`` calls it with the same arguments, and every rank returns the same measurement.

    For each size (``sizes``: per-rank buffer bytes, increasing; default 4 KiB .. 16 MiB, x4 a step)
    each collective runs ``repeats`` times behind a barrier; a run's time is the slowest rank's (an
    all-reduce of the maxima), a size's the median run. A collective stops growing once a size takes
    ``LONG_ENOUGH_S`` (measured well: on a token-bucket link, well past its burst); the all-reduce
    also where its next size would overrun ``time_budget_s`` (after ``MIN_SIZES`` sizes): the
    all-to-all's bandwidth, which every topology prices, is measured well whatever the budget. About
    a second on a 2 Gbit/s network of 4 ranks, less on a faster one. :func:`fit_line` fits each
    collective. Every decision and number comes from those all-reduced times, so the ranks agree
    without a broadcast.
    A one-rank group sends nothing: bandwidths ``ONE_RANK_BANDWIDTH`` (1e12 bytes/ms; infinite ones
    would break TorchRec's divisions) and no fixed cost, without running a collective.
    """
    sizes = list(DEFAULT_SIZES if sizes is None else sizes)
    _check_args(sizes, repeats, time_budget_s)
    group = pg if pg is not None else dist.GroupMember.WORLD if dist.is_initialized() else None
    if group is None:
        raise RuntimeError("measure_network needs an initialised default process group, or pg")
    return _measure(group, sizes, repeats, time_budget_s)


def _measure(pg: dist.ProcessGroup, sizes: List[int], repeats: int, time_budget_s: float) -> NetworkMeasurement:
    """:func:`measure_network` on ``pg``, its arguments checked."""
    world, backend = dist.get_world_size(pg), str(dist.get_backend(pg))
    if world == 1:
        m = NetworkMeasurement(1, ONE_RANK_BANDWIDTH, ONE_RANK_BANDWIDTH, 0.0, backend)
        logger.info("%s (one rank: nothing crosses the network)", m)
        return m
    dev = collective_device(pg)
    start = time.perf_counter()
    for op in (ALL_TO_ALL, ALL_REDUCE):  # first use: the backend's buffers, lazily made connections
        _timed(op, sizes[0], 1, pg, dev)
    samples: dict = {ALL_TO_ALL: [], ALL_REDUCE: []}
    growing = {ALL_TO_ALL: True, ALL_REDUCE: True}
    elapsed = 0.0
    for i, size in enumerate(sizes):
        for op in (o for o in (ALL_TO_ALL, ALL_REDUCE) if growing[o]):
            nbytes, times = _timed(op, size, repeats, pg, dev)
            shared = torch.tensor(times + [time.perf_counter() - start], dtype=torch.float64, device=dev)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=pg)  # the slowest rank's, on every rank
            shared_cpu = shared.cpu().tolist()
            elapsed = shared_cpu[-1]
            sent = nbytes * (world - 1) // world if op == ALL_TO_ALL else nbytes
            samples[op].append((sent, statistics.median(shared_cpu[:-1])))
            if len(samples[op]) >= MIN_SIZES and samples[op][-1][1] >= LONG_ENOUGH_S:
                growing[op] = False
        if i + 1 == len(sizes) or not any(growing.values()):
            break
        step = sizes[i + 1] / size  # the next size's runs, at the time per byte of this one's
        predicted = sum(repeats * samples[op][-1][1] * step for op in growing if growing[op])
        if growing[ALL_REDUCE] and len(samples[ALL_REDUCE]) >= MIN_SIZES and elapsed + predicted > time_budget_s:
            growing[ALL_REDUCE] = False  # gives way to the all-to-all
        if not any(growing.values()):
            break
    ms_a2a, bw_a2a = fit_line(samples[ALL_TO_ALL])
    _, bw_ar = fit_line(samples[ALL_REDUCE])
    m = NetworkMeasurement(world, bw_a2a, bw_ar, ms_a2a, backend, tuple(samples[ALL_TO_ALL]),
                           tuple(samples[ALL_REDUCE]), elapsed)
    logger.info("%s", m)
    logger.debug("network samples (bytes, s): all-to-all %s; all-reduce %s", m.all_to_all_samples,
                 m.all_reduce_samples)
    return m


__all__ = ["MeasuredCommsBandwidth", "NetworkMeasurement", "fit_line", "measure_network"]
