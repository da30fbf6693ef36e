"""TorchRec's estimators for every option, from the one cost model (cost_model.py).

TorchRec's partitioner balances ranks by ``shard.perf``, and its planner picks the proposal whose
busiest rank is cheapest; its storage estimator raises for an unknown sharding type. If hybrid
options were priced by our model and stock ones by TorchRec's estimators, the comparison would mix
units: :class:`BytesPerfEstimator` prices every option, stock or hybrid, by the cost model (ms),
:class:`StepPerfModel` rates proposals as the fitted prices blend ranks, and
:class:`HybridStorageEstimator` sets the memory of frequency_hybrid options. The helpers read the
sharders (fused params, optimizer, quantized comms) the way TorchRec's planner reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional

import torch
from torchrec.distributed.planner.types import (ParameterConstraints, Perf, PerfModel, ShardEstimator,
                                              ShardingOption, Storage, Topology)
from torchrec.distributed.planner.utils import build_sharder_data, sharder_name

from torchrec_hybrid import _compat
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.types import FREQUENCY_HYBRID


def on_device(topology: Topology) -> bool:
    """Whether the topology's ranks keep tables in device memory (HBM: CUDA / MTIA) rather than DDR."""
    return topology.compute_device in ("cuda", "mtia")


def fused_params(sharder_data_map, so: ShardingOption) -> Dict[str, Any]:
    """The fused_params of the option's sharder ({} if none given)."""
    data = (sharder_data_map or {}).get(so.module_type_key)
    return getattr(data, "fused_params", None) or {}


def optimizer_name(sharder_data_map, so: ShardingOption) -> Optional[str]:
    """The name of the optimizer the table is built with: the class ``apply_optimizer_in_backward``
    set on its parameter (where TorchRec's storage estimator reads it:
    ``_compat.optimizer_classes_in_backward``; it wins over the sharder's in TorchRec's sharding,
    ``merge_fused_params``), else the sharder's fused optimizer, else None."""
    classes = _compat.optimizer_classes_in_backward(so.tensor)
    if classes:
        return classes[0].__name__
    opt = fused_params(sharder_data_map, so).get("optimizer")
    if opt is None:
        return None
    return getattr(opt, "name", None) or str(opt)


def sharder_vectorised_backward(sharders: Iterable[Any]) -> Dict[str, bool]:
    """``cost_model.vectorised_cpu_backward`` of each sharder's fused_params by the module type it shards
    (the key of ``ShardingOption.module_type_key``)."""
    return {sharder_name(s.module_type): cm.vectorised_cpu_backward(getattr(s, "fused_params", None))
            for s in sharders}


def comm_elems(sharder_data_map, so: ShardingOption) -> Optional[cm.CommElems]:
    """Bytes per element the option's sharder puts on the pooled collectives, from TorchRec's
    ``SharderData.qcomm_dtype_sizes`` (its codecs' ``quantized_dtype``, forward and backward;
    what TorchRec's own estimators price stock types with); None without sharder data."""
    data = (sharder_data_map or {}).get(so.module_type_key)
    if data is None:
        return None
    return cm.CommElems.from_qcomm_dtype_sizes(getattr(data, "qcomm_dtype_sizes", None))


def sharder_comms(sharders: Iterable[Any]) -> Dict[str, cm.CommElems]:
    """:func:`comm_elems` of each sharder by the module type it shards (the key of
    ``ShardingOption.module_type_key``), for pricing plans outside an enumerator."""
    return {sharder_name(s.module_type): cm.CommElems.from_qcomm_dtype_sizes(build_sharder_data(s).qcomm_dtype_sizes)
            for s in sharders}


class BytesPerfEstimator(ShardEstimator):
    """``shard.perf`` of every option from the cost model (``cost_model.shard_costs``).

    A shard's comms are the traffic of its table that passes through its owner: what the
    owner sends plus what the other ranks send it, so the per-rank sums the partitioner
    balances add up to the plan's traffic; its compute, the work of its table on its owner
    (and, for one-shard options, on every rank: it all exists because of this shard).
    One-shard options (table_wise, hybrid with table-wise cold) are priced as if on rank 0:
    by symmetry any owner costs the same.
    """

    def __init__(self, topology: Topology, traffic: cm.TrafficTable, compute: Optional[cm.ComputeCosts] = None
                 ) -> None:
        self._world = topology.world_size
        self._bw = cm.a2a_bandwidth(topology)
        self._traffic = traffic
        self._compute = compute

    def estimate(self, sharding_options, sharder_data_map=None, sharder_map=None) -> None:
        for so in sharding_options:
            data = (sharder_data_map or {}).get(so.module_type_key)
            for shard, (fwd, comms) in zip(so.shards, cm.shard_costs(so, self._traffic, self._world, self._bw, data,
                                                                     self._compute)):
                shard.perf = Perf(fwd_compute=fwd, fwd_comms=comms, bwd_compute=0.0, bwd_comms=0.0)


class StepPerfModel(PerfModel):
    """Rates a proposal as TorchRec's ``NoopPerfModel`` does (each rank's summed shard perf),
    but blends the busiest rank with the mean rank as the prices say (``ComputeCosts.step_ms``):
    an approximation of ``cost_model.plan_cost``'s blend (shard perf puts a one-shard option's
    work on its owner and leaves out module overheads). With ``busiest_share`` 1 it is
    ``NoopPerfModel``."""

    def __init__(self, topology: Topology, compute: cm.ComputeCosts) -> None:
        self._topology = topology
        self._compute = compute

    def rate(self, plan: List[ShardingOption]) -> float:
        perfs = torch.zeros(self._topology.world_size, dtype=torch.float64)
        for so in plan:
            for shard in so.shards:
                perfs[shard.rank] += shard.perf.total  # type: ignore[union-attr, index]
        return float(self._compute.step_ms(perfs))


class HybridStorageEstimator(ShardEstimator):
    """Sets ``shard.storage`` of frequency_hybrid options (``FrequencyHybrid.memory_bytes`` +
    ``step_buffer_bytes``): per rank the shard's cold rows with the optimizer's state (the sharder's
    fused optimizer - the stock estimator counts 0 for an optimizer given that way - or one applied
    in backward: :func:`optimizer_name`), the hot replica, the step's buffers.
    """

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None) -> None:
        self._topology = topology
        self._constraints = constraints

    def estimate(self, sharding_options, sharder_data_map=None, sharder_map=None) -> None:
        t = self._topology
        hbm = on_device(t)
        for so in sharding_options:
            if so.sharding_type != FREQUENCY_HYBRID:
                continue
            ch = getattr(so, "hybrid_choice", None)
            if ch is None:
                raise ValueError(f"table {so.name!r}: frequency_hybrid option without a hot-set choice")
            tr, elem = cm.traffic_of(so, t.world_size), so.tensor.element_size()
            io = cm.HYBRID.step_buffer_bytes(tr, elem)
            for shard in so.shards:  # a column-wise cold slice: its width's share
                ts = tr if shard.size[1] == tr.dim else dataclasses.replace(tr, dim=shard.size[1])
                state = cm.optimizer_state_bytes_per_row(optimizer_name(sharder_data_map, so), ts.dim)
                mem = cm.HYBRID.memory_bytes(ts, ch.hot_rows, state, cold_rows=shard.size[0], elem=elem) + io
                shard.storage = Storage(hbm=mem if hbm else 0, ddr=0 if hbm else mem, ssd=0)
