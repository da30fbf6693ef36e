"""Perf and storage estimators for ``frequency_hybrid`` sharding options.

TorchRec's perf estimator silently prices an unknown sharding type as table-wise and its
storage estimator raises for it, so hybrid options get these instead (the enumerator routes
stock options to the stock estimators and hybrid ones here). Both read the table's
:class:`HotSetChoice` from ``sharding_option.hybrid_choice``.

Units follow TorchRec's estimators (bandwidths in bytes/ms, so perf in ms). Comms are the
cost model's true bytes per rank divided by the topology's bandwidth of each collective,
times ``W/(W-1)``: TorchRec prices an all-to-all by a rank's whole output including the part
it keeps, so a table-wise table costs ``W*B*D*4`` on its owner, ``B*D*4`` per rank on
average; the factor puts the hybrid on that same scale (and leaves the choice of H, which
only depends on the ratio of the terms, unchanged).
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

from torchrec.distributed.planner.constants import BIGINT_DTYPE, kernel_bw_lookup
from torchrec.distributed.planner.types import (
    CollectiveType,
    ParameterConstraints,
    Perf,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner.types import HotSetChoice
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)

A2A_PARTS = ("lengths", "cold_ids", "partials")


def traffic_of(so: ShardingOption, world_size: int) -> cm.TableTraffic:
    """The cost model's view of a sharding option (pooling = mean ids per bag per feature)."""
    rows, dim = so.tensor.shape[0], so.tensor.shape[1]
    feats = max(1, len(so.input_lengths))
    pooling = sum(so.input_lengths) / feats if so.input_lengths else 1.0
    return cm.TableTraffic(rows=rows, dim=dim, features=feats, pooling=pooling,
                           batch=so.batch_size, world=world_size)


def bandwidths(topology: Topology) -> Dict[str, float]:
    """Bandwidth (bytes/ms) of each collective the hybrid uses, from the topology."""
    bw = topology.comms_bandwidths
    args = dict(world_size=topology.world_size, local_world_size=topology.local_world_size)
    return {
        "a2a": bw.get_bw(collective_type=CollectiveType.ALL_TO_ALL, **args),
        "allreduce": bw.get_bw(collective_type=CollectiveType.ALL_REDUCE, **args),
        "reduce_scatter": bw.get_bw(collective_type=CollectiveType.REDUCE_SCATTER, **args),
    }


def optimizer_name(sharder_data_map, so: ShardingOption) -> Optional[str]:
    """The fused optimizer's name from the sharder's fused_params (None if not given)."""
    data = (sharder_data_map or {}).get(so.module_type_key)
    opt = (getattr(data, "fused_params", None) or {}).get("optimizer")
    if opt is None:
        return None
    return getattr(opt, "name", None) or str(opt)


def _choice(so: ShardingOption) -> HotSetChoice:
    choice = getattr(so, "hybrid_choice", None)
    if choice is None:
        raise ValueError(f"table {so.name!r}: frequency_hybrid option without a hot-set choice")
    return choice


class _HybridEstimator(ShardEstimator):
    """Shared constructor: both estimators price from the topology (and constraints)."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None) -> None:
        self._topology = topology
        self._constraints = constraints


class HybridPerfEstimator(_HybridEstimator):
    """Sets ``shard.perf`` of frequency_hybrid options (per rank; every rank holds one shard).

    fwd_comms: cold ids + lengths (input dist), forward partials and the owners' hot rows;
    bwd_comms: backward partials and hot-row gradients (all in the output all-to-alls).
    Compute: reading ids, TBE lookups of hot ids locally and of cold ids (and owned hot
    rows) on their owner, writing hot sums and partial sums; backward is
    ``bwd_compute_multiplier`` times that plus assembling and summing the hot rows.
    """

    def estimate(self, sharding_options, sharder_data_map=None, sharder_map=None) -> None:
        t = self._topology
        w = t.world_size
        bw = bandwidths(t)
        scale = w / (w - 1) if w > 1 else 1.0
        for so in sharding_options:
            if so.sharding_type != FREQUENCY_HYBRID:
                continue
            ch = _choice(so)
            tr = traffic_of(so, w)
            parts = {k: float(v) for k, v in cm.hybrid_bytes(tr, ch.coverage, ch.hot_rows).items()}
            dev_bw = kernel_bw_lookup(t.compute_device, so.compute_kernel, t.hbm_mem_bw, t.ddr_mem_bw,
                                      t.hbm_to_ddr_mem_bw)
            cold = 1.0 - ch.coverage
            elem = so.tensor.element_size()
            fwd_compute = (tr.lookups * BIGINT_DTYPE + tr.lookups * tr.dim * elem
                           + tr.bags * tr.dim * elem * (1.0 + cold)) / dev_bw
            hot_bytes = max(ch.hot_rows, 1) * (tr.dim + 1) * elem
            bwd_compute = t.bwd_compute_multiplier * fwd_compute + 3 * hot_bytes / dev_bw
            input_dist = scale * (parts["lengths"] + parts["cold_ids"]) / bw["a2a"]
            fwd_comms = scale * parts["partials"] / 2 / bw["a2a"]
            fwd_comms += scale * parts["hot_sync"] / 2 / bw["a2a"]  # hot rows out to the replicas
            bwd_comms = scale * (parts["partials"] + parts["hot_sync"]) / 2 / bw["a2a"]
            for shard in so.shards:
                shard.perf = Perf(fwd_compute=fwd_compute, fwd_comms=fwd_comms, bwd_compute=bwd_compute,
                                  bwd_comms=bwd_comms, input_dist_comms=input_dist)


class HybridStorageEstimator(_HybridEstimator):
    """Sets ``shard.storage`` of frequency_hybrid options.

    Per rank: the cold row-wise block with the fused optimizer's state (taken from the
    sharder's fused_params: the stock estimator counts 0 for an optimizer given that way),
    the hot replica (>= 1 row, no optimizer state: owners apply the updates), plus the step's buffers: input ids, the owner's
    ``[W*B, D]`` partial sums and the ``[B, D]`` hot sums per feature.
    """

    def estimate(self, sharding_options, sharder_data_map=None, sharder_map=None) -> None:
        t = self._topology
        w = t.world_size
        on_device = t.compute_device in ("cuda", "mtia")
        for so in sharding_options:
            if so.sharding_type != FREQUENCY_HYBRID:
                continue
            ch = _choice(so)
            tr = traffic_of(so, w)
            elem = so.tensor.element_size()
            per_row = tr.dim * elem + cm.optimizer_state_bytes_per_row(optimizer_name(sharder_data_map, so), tr.dim)
            io = math.ceil(tr.lookups * BIGINT_DTYPE + (w + 1) * tr.bags * tr.dim * elem)
            for shard in so.shards:
                mem = shard.size[0] * per_row + max(ch.hot_rows, 1) * tr.dim * elem + io
                shard.storage = Storage(hbm=mem if on_device else 0, ddr=0 if on_device else mem, ssd=0)
