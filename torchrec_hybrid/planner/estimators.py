"""Storage estimator for ``frequency_hybrid`` options, and the helpers every estimator shares.

TorchRec's storage estimator raises for an unknown sharding type, so hybrid options get
:class:`HybridStorageEstimator` (it reads ``sharding_option.hybrid_choice``). Perf of every
option, stock or hybrid, comes from one byte model: ``plan_cost.BytesPerfEstimator``.
Units follow TorchRec's estimators (bandwidths in bytes/ms, so perf in ms). Quantized comms
reach the cost model as TorchRec's planner reads them (:func:`comm_elems`, :func:`sharder_comms`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional

from torchrec.distributed.planner.types import (
    CollectiveType,
    ParameterConstraints,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)

from torchrec_hybrid import _compat
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner.plan_cost import traffic_of
from torchrec_hybrid.types import FREQUENCY_HYBRID


def bandwidths(topology: Topology) -> Dict[str, float]:
    """Bandwidth (bytes/ms) of each collective the hybrid uses, from the topology."""
    bw = topology.comms_bandwidths
    args = dict(world_size=topology.world_size, local_world_size=topology.local_world_size)
    return {
        "a2a": bw.get_bw(collective_type=CollectiveType.ALL_TO_ALL, **args),
        "allreduce": bw.get_bw(collective_type=CollectiveType.ALL_REDUCE, **args),
        "reduce_scatter": bw.get_bw(collective_type=CollectiveType.REDUCE_SCATTER, **args),
    }


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


def vectorised_cpu_backward(params: Optional[Dict[str, Any]]) -> bool:
    """Whether FBGEMM's CPU TBE backward takes its vectorised path for a table looked up by one
    feature under these fused params - EXACT_ROWWISE_ADAGRAD (none given: FBGEMM's EXACT_SGD, whose
    backward is scalar either way) without weight decay (with it, heavy tables get a call of their
    own, lookup.py): then looking such a table up through virtual features costs its scalar path
    (``cost_model.VIRTUAL_BACKWARD_EXTRA``). Only the sharder's fused_params are read: an optimizer
    set per parameter (``apply_optimizer_in_backward``) is priced as FBGEMM's default here (its
    state is counted: :func:`optimizer_name`)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    p = params or {}
    return (p.get("optimizer", EmbOptimType.EXACT_SGD) == EmbOptimType.EXACT_ROWWISE_ADAGRAD
            and not float(p.get("weight_decay", 0.0) or 0.0))


def sharder_vectorised_backward(sharders: Iterable[Any]) -> Dict[str, bool]:
    """:func:`vectorised_cpu_backward` of each sharder's fused_params by the module type it shards
    (the key of ``ShardingOption.module_type_key``)."""
    from torchrec.distributed.planner.utils import sharder_name

    return {sharder_name(s.module_type): vectorised_cpu_backward(getattr(s, "fused_params", None)) for s in sharders}


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
    from torchrec.distributed.planner.utils import build_sharder_data, sharder_name

    return {sharder_name(s.module_type): cm.CommElems.from_qcomm_dtype_sizes(build_sharder_data(s).qcomm_dtype_sizes)
            for s in sharders}


class HybridStorageEstimator(ShardEstimator):
    """Sets ``shard.storage`` of frequency_hybrid options, from the cost model's memory terms.

    Per rank (``cm.hybrid_memory_bytes`` + ``cm.hybrid_step_buffer_bytes``): the shard's cold
    rows with the optimizer's state (the sharder's fused optimizer - the stock estimator counts 0
    for an optimizer given that way - or one applied in backward: :func:`optimizer_name`), the hot
    replica, the step's buffers.
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
            tr, elem = traffic_of(so, t.world_size), so.tensor.element_size()
            io = cm.hybrid_step_buffer_bytes(tr, elem)
            for shard in so.shards:  # a column-wise cold slice: its width's share
                ts = tr if shard.size[1] == tr.dim else dataclasses.replace(tr, dim=shard.size[1])
                state = cm.optimizer_state_bytes_per_row(optimizer_name(sharder_data_map, so), ts.dim)
                mem = cm.hybrid_memory_bytes(ts, ch.hot_rows, state, cold_rows=shard.size[0], elem=elem) + io
                shard.storage = Storage(hbm=mem if hbm else 0, ddr=0 if hbm else mem, ssd=0)
