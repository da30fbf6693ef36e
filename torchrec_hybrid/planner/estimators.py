"""Storage estimator for ``frequency_hybrid`` options, and the helpers every estimator shares.

TorchRec's storage estimator raises for an unknown sharding type, so hybrid options get
:class:`HybridStorageEstimator` (it reads ``sharding_option.hybrid_choice``). Perf of every
option, stock or hybrid, comes from one byte model: ``plan_cost.BytesPerfEstimator``.
Units follow TorchRec's estimators (bandwidths in bytes/ms, so perf in ms).
"""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

from torchrec.distributed.planner.constants import BIGINT_DTYPE
from torchrec.distributed.planner.types import (
    CollectiveType,
    ParameterConstraints,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner.types import HotSetChoice
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)

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


class HybridStorageEstimator(_HybridEstimator):
    """Sets ``shard.storage`` of frequency_hybrid options.

    Per rank: the cold row-wise block with the fused optimizer's state (taken from the
    sharder's fused_params: the stock estimator counts 0 for an optimizer given that way),
    the hot replica (>= 1 row, no optimizer state: owners apply the updates), plus the step's buffers: input ids, the
    owner's ``[W*B, D]`` partial sums and the ``[B, D]`` hot sums per feature.
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
