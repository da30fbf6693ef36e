"""Our dist code on CUDA tensors: host syncs, time and equality with the CPU run, per step.

The GPU machines this project is lent now and then have PyTorch with CUDA, but no CUDA
build of FBGEMM (its wheel is about 450 MiB; 64 MiB can be carried there) and so no
TorchRec kernels. This script runs what is ours on the GPU, the hot path as a sharded module
drives it: the real ``HybridSparseFeaturesDist`` (``split_pack``: route, bucketize, pack the
non-empty cold bags), its cold exchange (``ColdIdsAllToAll``: the all-to-all, the step's one
host sync - a read of ``exchange_summary`` -, a spill) and ``unpack_cold`` (the owner's lane
KJTs and output send plan: a ``HybridLookupInput``), then ``HybridPooledEmbeddingDist``
(``receive_plan``, the output all-to-all of partial sums and hot rows, the hot pooling,
forward and backward). CUDA tensors take ``sharding/composed.py``'s ops (fused.py dispatches
to the fused C++ ops on CPU tensors only), with:

- the FBGEMM sparse ops those call (:data:`STANDIN_OPS`: cyclic bucketize, segment permute,
  complete and exclusive cumsum) given CUDA implementations made of torch ops
  (:func:`register_standins`), each checked against FBGEMM's own CPU kernel first;
- the two lookups' TBE kernels replaced by torch stand-ins of the same shapes (a sum of
  embedding rows per bag, :func:`_pool`), since they are FBGEMM's, not ours: the owner's cold
  TBEs over ``HybridLookupInput.lane_kjts`` (the script's lookup, :meth:`Dists.lookup`), and the
  hot pooling's dense TBE (``HotPooling.pool``, swapped on the device side's replicas: :func:`_hot_pool`).

Every step runs under ``torch.cuda.set_sync_debug_mode("warn")``: each device-to-host sync
warns, and the warnings are counted per step with the line that caused them. The same
steps run on CPU - through the fused ops where the extension is built, FBGEMM's real CPU
kernels where the path calls FBGEMM - and must give the same pooled output and gradients.
Timings are CUDA events around the whole dist path, median over the steps.

Run on a GPU machine with torchrec and fbgemm-gpu-cpu importable (for the Python modules
and the CPU reference):  ``python -m benchmarks.device_check --out DIR``.
On a machine without CUDA it runs the CPU side only (``--device cpu``); the tests run the
"device" side on CPU, through the stand-ins and the composed ops.
"""

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

# what sharding/composed.py (and row_blocks / segments, which it calls) dispatches to FBGEMM
STANDIN_OPS = ("bucketize_sparse_features", "permute_1D_sparse_data", "asynchronous_complete_cumsum",
               "asynchronous_exclusive_cumsum")


# ---------------------------------------------------------------------------------------------
# FBGEMM's sparse ops as torch ops (no host sync, no data-dependent shape)
# ---------------------------------------------------------------------------------------------

def _complete_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.new_zeros(1), torch.cumsum(t, 0).to(t.dtype)])


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, 0).to(t.dtype) - t


def _bucketize_cyclic(lengths, indices, bucketize_pos, my_size, weights=None):
    """``bucketize_sparse_features`` with ``bucketize_pos=False``: id i to bucket i % size as
    i // size; lengths per (bucket, bag), ids bucket after bucket in the bags' order."""
    if bucketize_pos:
        raise NotImplementedError("the stand-in does not return bucketized positions")
    bags, n = lengths.numel(), indices.numel()
    bag = torch.repeat_interleave(torch.arange(bags, device=lengths.device), lengths.to(torch.int64),
                                  output_size=n)
    bucket = torch.remainder(indices, my_size).to(torch.int64)
    key = bucket * bags + bag
    order = torch.sort(key, stable=True).indices
    new_lengths = torch.zeros(my_size * bags, dtype=lengths.dtype, device=lengths.device)
    new_lengths.index_add_(0, key, torch.ones_like(key, dtype=lengths.dtype))
    rows = torch.div(indices, my_size, rounding_mode="floor").index_select(0, order)
    return new_lengths, rows, None if weights is None else weights.index_select(0, order), None


def _permute_1d(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    """``permute_1D_sparse_data``: segment ``permute[i]`` of ``values`` becomes segment i."""
    perm = permute.to(torch.int64)
    lengths64 = lengths.to(torch.int64)
    new_lengths = lengths.index_select(0, perm)
    moved = lengths64.index_select(0, perm)
    total = permuted_lengths_sum if permuted_lengths_sum is not None else int(moved.sum())  # a sync
    shift = _exclusive_cumsum(lengths64).index_select(0, perm) - _exclusive_cumsum(moved)
    pos = torch.arange(total, device=values.device) + torch.repeat_interleave(shift, moved, output_size=total)
    return (new_lengths, values.index_select(0, pos),
            None if weights is None else weights.index_select(0, pos))


_LIBRARY: Optional[Any] = None


def register_standins(dispatch_key: str = "CUDA", override: bool = False) -> List[str]:
    """Gives the FBGEMM sparse ops without a ``dispatch_key`` kernel (all of them with
    ``override``: the tests swap FBGEMM's CPU kernels for them) the torch stand-ins above as
    that kernel; returns the ops so registered."""
    global _LIBRARY
    import fbgemm_gpu  # noqa: F401 - defines the ops' schemas

    fns: Dict[str, Callable] = dict(zip(STANDIN_OPS, (_bucketize_cyclic, _permute_1d, _complete_cumsum,
                                                      _exclusive_cumsum)))
    ops = [n for n in STANDIN_OPS
           if override or not torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{n}", dispatch_key)]
    if ops:
        _LIBRARY = _LIBRARY or torch.library.Library("fbgemm", "IMPL")
        for n in ops:
            _LIBRARY.impl(n, fns[n], dispatch_key, **({"allow_override": True} if override else {}))
    return ops


# ---------------------------------------------------------------------------------------------
# the TBE stand-ins
# ---------------------------------------------------------------------------------------------

def _pool(weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, bags: int,
          per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stand-in for a SUM-pooling TBE: ``[bags, D]`` sums of ``weight`` rows per bag of
    ``offsets`` (``[bags + 1]``, may start past 0: ids outside every bag are not read; no host
    sync). A fresh tensor, never a view."""
    pos = torch.arange(ids.numel(), device=ids.device)
    bag = torch.searchsorted(offsets.to(torch.int64), pos, right=True) - 1  # -1 before the first offset
    inside = (bag >= 0) & (bag < bags)
    rows = weight.index_select(0, torch.where(inside, ids.to(torch.int64), 0))
    scale = inside.to(weight.dtype) if per_sample_weights is None else torch.where(inside, per_sample_weights, 0)
    out = torch.zeros(bags, weight.size(1), dtype=weight.dtype, device=weight.device)
    return out.index_add_(0, torch.where(inside, bag, 0), rows * scale.unsqueeze(1))


def _hot_pool(rep, replica: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
              weights: Optional[torch.Tensor], batch: int) -> torch.Tensor:
    """``HotPooling.pool`` (FBGEMM's dense TBE over the group's flat replica) with :func:`_pool`:
    ``[batch, total_dim]``; one width per group (one replica table, rows = its rows)."""
    (dim,) = set(rep.table_dims)
    F = rep.num_features
    pooled = _pool(replica.view(-1, dim), rows, offsets, F * batch, weights)
    return pooled.view(F, batch, dim).transpose(0, 1).reshape(batch, F * dim)


def check_standins(seed: int = 0) -> Dict[str, bool]:
    """Each stand-in against FBGEMM's CPU kernel on the same random input (on the CPU)."""
    import fbgemm_gpu  # noqa: F401

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (60,), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    ids = torch.randint(0, 10_000, (n,), generator=g, dtype=torch.int32)
    w = torch.rand(n, generator=g)
    ours = _bucketize_cyclic(lengths, ids, False, 5, w)
    ref = torch.ops.fbgemm.bucketize_sparse_features(lengths, ids, False, 5, w)
    ok_b = all(torch.equal(a, b) for a, b in zip(ours[:3], ref[:3]))
    perm = torch.randperm(60, generator=g).to(torch.int32)
    total = int(lengths[perm.long()].sum())
    ours_p = _permute_1d(perm, lengths, ids, w, total)
    ref_p = torch.ops.fbgemm.permute_1D_sparse_data(perm, lengths, ids, w, total)
    ok_p = all(torch.equal(a, b) for a, b in zip(ours_p, ref_p))
    sizes = lengths.long()
    ok_c = all(torch.equal(_complete_cumsum(s), torch.ops.fbgemm.asynchronous_complete_cumsum(s))
               for s in (sizes, lengths))
    ok_e = torch.equal(_exclusive_cumsum(sizes), torch.ops.fbgemm.asynchronous_exclusive_cumsum(sizes))
    return dict(zip(STANDIN_OPS, (ok_b, ok_p, ok_c, ok_e)))


# ---------------------------------------------------------------------------------------------
# one sharding's dists, and a step through them
# ---------------------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    batch: int  # per rank
    multi_hot: bool
    max_rows: int = 100_000
    dim: int = 64
    hot_rows: int = 2048  # per table (fewer for small tables)


WORKLOADS = [Workload("one-hot B=1024", 1024, False), Workload("DLRMv2 multi-hot B=512", 512, True)]


@dataclass
class Dists:
    """One rank's frequency_hybrid dists on one device, its lanes, and the stand-in cold lookup's weights
    (one table every feature looks up: the cold TBEs' stand-in)."""

    input_dist: Any
    output_dist: Any
    lane_slots: List[int]
    cold_weight: torch.Tensor
    _grad: Optional[torch.Tensor] = None

    def lookup(self, lane_kjts: List[Any]) -> torch.Tensor:
        """The owner's cold lookup (``HybridLookup.forward``) with :func:`_pool` for its TBEs: every lane's
        ``[batch, slots * D]``, flattened, one after another (cells.LaneLayout)."""
        outs = []
        for slots, kjt in zip(self.lane_slots, lane_kjts):
            lengths = kjt.lengths()
            batch = lengths.numel() // slots
            pooled = _pool(self.cold_weight, kjt.values(), _complete_cumsum(lengths.to(torch.int64)), slots * batch,
                           kjt.weights_or_none())
            outs.append(pooled.view(slots, batch, -1).transpose(0, 1).reshape(-1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def grad_weights(self, pooled: torch.Tensor) -> torch.Tensor:
        """A fixed, non-uniform upstream gradient (the same on every device)."""
        if self._grad is None or self._grad.shape != pooled.shape:
            n = pooled.numel()
            self._grad = torch.cos(torch.arange(n, dtype=torch.float64)).to(pooled.dtype).view(pooled.shape).to(
                pooled.device)
        return self._grad


def _grouped_config(sizes: List[int], names: List[str], dim: int, world: int, rank: int):
    """A one-group config of the tables' row-wise cold shards (what the sharding builds)."""
    from torchrec.distributed.embedding_types import GroupedEmbeddingConfig, ShardedEmbeddingTable
    from torchrec.modules.embedding_configs import DataType, PoolingType

    from torchrec_hybrid import row_blocks

    tables = []
    for n, name in zip(sizes, names):
        b = row_blocks.even_bounds(n, world)
        tables.append(ShardedEmbeddingTable(
            num_embeddings=n, embedding_dim=dim, name=f"t_{name}", feature_names=[name],
            pooling=PoolingType.SUM, local_rows=b[rank + 1] - b[rank], local_cols=dim))
    return GroupedEmbeddingConfig(data_type=DataType.FP32, pooling=PoolingType.SUM, is_weighted=False,
                                  has_feature_processor=False, compute_kernel="fused", embedding_tables=tables)


def build_dists(w: Workload, pg: dist.ProcessGroup, device: torch.device, hot: List[torch.Tensor],
                sizes: List[int], names: List[str], standin_tbe: bool = False) -> Dists:
    """The real input and output dists of one frequency_hybrid sharding (row-wise cold rows, hot set
    ``hot``, the owner's lanes), as ``hybrid_sharding.py`` builds them. ``standin_tbe``: the hot
    pooling through :func:`_hot_pool` (on CUDA it must: no CUDA kernel for FBGEMM's dense TBE)."""
    from torchrec_hybrid import row_blocks
    from torchrec_hybrid.sharding.hot_state import build_hot_state
    from torchrec_hybrid.sharding.input_dist import HybridSparseFeaturesDist
    from torchrec_hybrid.sharding.lookup import lanes_of
    from torchrec_hybrid.sharding.output_dist import HybridPooledEmbeddingDist

    W, rank = pg.size(), pg.rank()
    F = len(sizes)
    bounds = [row_blocks.even_bounds(n, W) for n in sizes]
    config = _grouped_config(sizes, names, w.dim, W, rank)
    # built on the CPU (its replica's FBGEMM dense TBE has no CUDA kernel here), then moved
    state = build_hot_state([config], [hot], [bounds], W, rank, torch.device("cpu"))
    state = replace(state, layout=state.layout.to(device), feature_shift=state.feature_shift.to(device))
    if standin_tbe or device.type != "cpu":
        for rep in state.replicas:  # HotState.pool calls each replica's pool
            rep.pool = functools.partial(_hot_pool, rep)
    _, lanes, keys = lanes_of([config], set(), W, set(), device)  # no heavy table on even row blocks: one lane
    inp = HybridSparseFeaturesDist(pg, list(range(F)), sizes, state, bounds, device, lanes, keys,
                                   feature_dims=[w.dim] * F)
    out = HybridPooledEmbeddingDist(pg, [w.dim] * F, [False] * F, device)
    g = torch.Generator().manual_seed(1234 + rank)
    rows = max(b[rank + 1] - b[rank] for b in bounds)
    cold_weight = torch.randn(max(rows, 1), w.dim, generator=g).to(device).requires_grad_()
    return Dists(inp, out, list(lanes.lane_slots), cold_weight)


def _no_mark(name: str) -> None:
    return None


def run_step(d: Dists, kjt, report_words: torch.Tensor, mark: Callable[[str], None] = _no_mark):
    """One forward and backward through the dists; returns the pooled output ``[B, F * D]``
    and the gradient of the stand-in cold weights. ``mark(phase)`` is called as each phase
    (input dist, lookup, output dist, backward) ends."""
    from torchrec_hybrid.sharding.lookup import HybridLookupOutput

    aw = d.input_dist(kjt)
    aw.start(report_words)
    inp = aw.wait().wait()  # the exchange and its sync, then the spill and the owner's unpacking
    mark("input_dist")
    cold = d.lookup(inp.lane_kjts)
    mark("lookup")
    pooled = d.output_dist(HybridLookupOutput(cold, inp)).wait()
    mark("output_dist")
    g = d.grad_weights(pooled)
    d.cold_weight.grad = None
    (pooled * g).sum().backward()
    mark("backward")
    return pooled.detach(), d.cold_weight.grad


# ---------------------------------------------------------------------------------------------
# per rank
# ---------------------------------------------------------------------------------------------

def _package_dirs() -> tuple:
    import torchrec

    import torchrec_hybrid

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (torchrec_hybrid, torchrec))


_PACKAGES: tuple = ()


class OpOrigin(TorchDispatchMode):
    """Counts dispatched ops by origin: ``ours`` when torchrec_hybrid's code (or TorchRec's,
    which it calls) is on the stack, ``harness`` otherwise: this script's stand-ins and glue, and
    the backward ops of PyTorch's built-in derivatives, which the autograd engine runs with no
    Python frame of ours on the stack (our own autograd Functions' backward counts as ours). An
    op a stand-in implements counts once, as its caller's (the mode is off inside)."""

    def __init__(self) -> None:
        global _PACKAGES
        super().__init__()
        self.counts = {"ours": 0, "harness": 0}
        _PACKAGES = _PACKAGES or _package_dirs()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        origin = "harness"
        while frame is not None:
            name = frame.f_code.co_filename
            if name == __file__:
                break
            if name.startswith(_PACKAGES):
                origin = "ours"
                break
            frame = frame.f_back
        self.counts[origin] += 1
        return func(*args, **(kwargs or {}))


def count_launches(step: Callable[[], Any]) -> Dict[str, int]:
    """Kernel launches and memory copies one call of ``step`` makes, and the kernels' total
    time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, OpOrigin() as origin:
        step()
        torch.cuda.synchronize()
    counts: Dict[str, Any] = {"kernels": 0, "memcpy": 0, "memset": 0, "ops": origin.counts}
    averages = prof.key_averages()
    # the kernels' own time: the device-side kernel events only (a CPU op's self device time is
    # its kernels' time again, and a record_function range's GPU annotation spans its kernels, so
    # summing those would count kernels twice; copies and fills are not kernels). NCCL's kernels
    # are in, their waiting included.
    counts["gpu_kernel_ms"] = sum(e.self_device_time_total for e in averages if e.device_type != DeviceType.CPU
                                  and not getattr(e, "is_user_annotation", False)
                                  and not e.key.startswith(("Memcpy", "Memset"))) / 1e3
    for e in averages:
        name = e.key.lower()
        if "launchkernel" in name:
            counts["kernels"] += e.count
        elif name.startswith("cudamemcpy"):
            counts["memcpy"] += e.count
        elif name.startswith("cudamemset"):
            counts["memset"] += e.count
    return counts


class SyncCounter:
    """Counts CUDA device-to-host syncs (``torch.cuda.set_sync_debug_mode("warn")``) by the
    line that caused them."""

    def __init__(self) -> None:
        self.sites: Dict[str, int] = {}

    def __enter__(self) -> "SyncCounter":
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        for r in self._records:
            if "synchroniz" in str(r.message):
                site = f"{Path(r.filename).name}:{r.lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _batches(w: Workload, world: int, steps: int, rank: int):
    from benchmarks.data import rank_slice
    from torchrec_hybrid.stats import SyntheticCriteo, criteo_table_sizes

    sizes = criteo_table_sizes(max_rows=w.max_rows)
    data = SyntheticCriteo(sizes, w.batch * world, steps, multi_hot=w.multi_hot, seed=7)  # warm-up + timed
    kjts = list(data)
    hot = [data.top_ids(0, min(w.hot_rows, n))[f].sort().values for f, n in zip(data.feature_names, sizes)]
    # each rank takes its slice of the global batch (as the sharded module's input)
    local = [rank_slice(k, data.hotness, rank, w.batch) for k in kjts]
    return sizes, list(data.feature_names), hot, local


def rank_main(rank: int, world: int, emit, steps: int, warmup: int, device: str, pg_backend: str) -> None:
    """Per workload: the dists on CPU (the fused ops where built, FBGEMM's CPU kernels) and on ``device``
    (the composed ops, the stand-ins); the same steps through both, compared; syncs and times on the
    device."""
    from torchrec_hybrid.sharding import fused
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        register_standins()
    pg_dev = dist.group.WORLD
    pg_cpu = dist.new_group(backend="gloo") if pg_backend == "nccl" else dist.group.WORLD
    rows: List[Dict[str, Any]] = []
    for w in WORKLOADS:
        sizes, names, hot, local = _batches(w, world, warmup + steps, rank)
        ref = build_dists(w, pg_cpu, torch.device("cpu"), hot, sizes, names)
        mine = build_dists(w, pg_dev, dev, hot, sizes, names) if dev.type != "cpu" else ref
        words = torch.zeros(4, dtype=torch.int32)
        max_err, phases, syncs, walls = 0.0, [], [], []
        sites: Dict[str, int] = {}
        launches: Dict[str, int] = {}
        for i, kjt in enumerate(local):
            pooled_ref, grad_ref = run_step(ref, kjt, words)
            if dev.type == "cpu":
                continue
            dkjt, dwords = kjt.to(dev), words.to(dev)
            torch.cuda.synchronize()
            if i == warmup - 1:  # one warm step under the profiler: what it launches
                launches = count_launches(lambda: run_step(mine, dkjt, dwords))
                continue
            events = {"start": torch.cuda.Event(enable_timing=True)}

            def mark(name: str) -> None:
                events[name] = torch.cuda.Event(enable_timing=True)
                events[name].record()

            t0 = time.perf_counter()
            with SyncCounter() as counter:
                events["start"].record()
                pooled, grad = run_step(mine, dkjt, dwords, mark)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            err = max((pooled.cpu() - pooled_ref).abs().max().item(), (grad.cpu() - grad_ref).abs().max().item())
            max_err = max(max_err, err / max(1.0, pooled_ref.abs().max().item()))
            if i >= warmup:
                marks = list(events)
                phases.append({b: events[a].elapsed_time(events[b]) for a, b in zip(marks, marks[1:])})
                walls.append(wall)
                syncs.append(counter.total)
                for k, v in counter.sites.items():
                    sites[k] = sites.get(k, 0) + v
        row: Dict[str, Any] = dict(workload=w.name, world=world, backend=pg_backend, device=str(dev),
                                   steps=len(phases), ids_per_rank=int(local[0].values().numel()),
                                   cpu_reference="fused" if fused.available() else "composed")
        if phases:
            row.update(
                phase_ms={k: statistics.median(p[k] for p in phases) for k in phases[0]},
                step_ms=statistics.median(sum(p.values()) for p in phases),
                wall_ms=statistics.median(walls),
                syncs_per_step=(min(syncs), max(syncs)),
                sync_sites={k: v / len(syncs) for k, v in sorted(sites.items())},
                launches_per_step=launches,
                max_rel_diff=max_err,
            )
        rows.append(row)
    emit(rows)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def _origins(ops: Optional[Dict[str, int]]) -> str:
    return "-" if not ops else f"{ops['ours']} / {ops['harness']}"


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _reference(result: Dict[str, Any]) -> str:
    paths = {r.get("cpu_reference") for r in result["rows"]} - {None}
    return " / ".join(f"the {p} ops" for p in sorted(paths)) or "not recorded"


def markdown(result: Dict[str, Any]) -> str:
    lines = [f"# Our dist code on {result['gpu'] or 'CPU only'}", "",
             f"torch {result['torch']}; FBGEMM ops given torch CUDA stand-ins: "
             f"{', '.join(result['standins']) or 'none'}; stand-ins equal to FBGEMM's CPU kernels: "
             f"{all(result['standins_checked'].values())}; CPU reference: {_reference(result)}. Median of the "
             "timed steps; the lookup phase is the stand-in cold TBEs alone (the owner's index work is the input "
             "dist's), the output dist includes the hot pooling's stand-in dense TBE.", "",
             "| workload | W | backend | ids/rank | input dist | lookup | output dist | backward | step (ms) | "
             "host wall (ms) | GPU kernels (ms) | host syncs/step | where | kernel launches/step | "
             "ops dispatched: ours / harness | max rel. diff vs CPU |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        if "step_ms" not in r:
            continue
        s = r["syncs_per_step"]
        sync = f"{s[0]}" if s[0] == s[1] else f"{s[0]}-{s[1]}"
        where = ", ".join(f"{k} ({v:g})" for k, v in r["sync_sites"].items()) or "-"
        ph = r["phase_ms"]
        lines.append(f"| {r['workload']} | {r['world']} | {r['backend']} | {r['ids_per_rank']} | "
                     f"{ph['input_dist']:.2f} | {ph['lookup']:.2f} | {ph['output_dist']:.2f} | "
                     f"{ph['backward']:.2f} | {r['step_ms']:.2f} | {_ms(r.get('wall_ms'))} | "
                     f"{_ms(r['launches_per_step'].get('gpu_kernel_ms'))} | {sync} | {where} | "
                     f"{r['launches_per_step'].get('kernels', 0)} | {_origins(r['launches_per_step'].get('ops'))} | "
                     f"{r['max_rel_diff']:.1e} |")
    if result.get("note"):
        lines.append(f"\nNote: {result['note']}.")
    for e in result.get("errors", []):
        lines.append(f"\n{e}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    from torchrec_hybrid.spawn import RankFailure, spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--worlds", default="1,2", help="W=1 on NCCL (CUDA) / gloo; W>1 on gloo")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = args.device == "cuda"
    result: Dict[str, Any] = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if cuda else None,
                                  standins=register_standins() if cuda else [],
                                  standins_checked=check_standins(), rows=[], errors=[])
    for world in [int(x) for x in args.worlds.split(",")]:
        backend = "nccl" if cuda and world == 1 else "gloo"
        logger.info("W=%d on %s (%s)", world, backend, args.device)
        try:
            out = spawn_ranks(rank_main, world, timeout=600, backend=backend, steps=args.steps,
                              warmup=args.warmup, device=args.device, pg_backend=backend)
            result["rows"].extend(out[0][0])
        except RankFailure as e:
            result["errors"].append(f"W={world} ({backend}) failed: {str(e)[-1500:]}")
            logger.error("W=%d failed: %s", world, str(e)[-1500:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_check.json").write_text(json.dumps(result, indent=1))
    (args.out / "device_check.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
