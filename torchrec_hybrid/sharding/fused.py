"""The hot path's four steps, fused into one CPU op each where the extension is built, else composed.

``csrc/hybrid_ops.cpp`` registers ``torch.ops.torchrec_hybrid.{split_pack, exchange_summary,
unpack_cold, receive_plan}`` (built by ``scripts/setup.sh``; loaded on first use, never at
import). Each replaces a few dozen small torch / FBGEMM ops of ``composed.py`` - a training step
of the hybrid dispatched about three times the ops of a table-wise one, and on a CPU every one
costs more than its arithmetic here - with one pass over the same data and the same results.
Tensors on another device (CUDA: every op there is a kernel launch, no host work per element)
and a missing extension take ``composed.py``; ``TORCHREC_HYBRID_FUSED_OPS=0`` forces it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional

import torch

from torchrec_hybrid.sharding import composed
from torchrec_hybrid.sharding.cells import CellPositions, LaneLayout
from torchrec_hybrid.sharding.composed import ColdUnpacked, ExchangeLayout, Received, SplitPack
from torchrec_hybrid.sharding.hot_state import HotState

logger = logging.getLogger(__name__)

LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_hybrid_ops.so")
_state: dict = {}  # "loaded": whether the library is loaded (decided on first use)


def available() -> bool:
    """Whether the fused CPU ops are loaded (loads them on the first call; False if not built or turned off)."""
    if "loaded" not in _state:
        loaded = False
        if os.environ.get("TORCHREC_HYBRID_FUSED_OPS", "1") == "0":
            logger.info("TORCHREC_HYBRID_FUSED_OPS=0: the hybrid hot path runs its composed ops")
        elif hasattr(torch.ops.torchrec_hybrid, "split_pack"):  # loaded already (another copy of this module)
            loaded = True
        elif os.path.exists(LIBRARY):
            torch.ops.load_library(LIBRARY)
            loaded = True
        else:
            logger.warning("the hybrid hot path's fused CPU ops are not built (%s is missing: run scripts/setup.sh); "
                           "using its composed ops, which dispatch about 2x the ops per step", LIBRARY)
        _state["loaded"] = loaded
    return bool(_state["loaded"])


def fused_on(t: torch.Tensor) -> bool:
    """Whether the fused op serves a step whose tensors live where ``t`` does (CPU tensors, extension loaded)."""
    return t.device.type == "cpu" and available()


def split_pack(values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor],
               route_map: Optional[torch.Tensor], feature_key_offset: torch.Tensor, world: int,
               report: torch.Tensor, layout: ExchangeLayout, feature_units: Optional[torch.Tensor]) -> SplitPack:
    """:func:`composed.split_pack`, one op on the CPU (its ``sent_cells`` and ``payload`` exactly as long
    as what is sent, its hot rows compact with offsets from 0)."""
    if not fused_on(values):
        return composed.split_pack(values, lengths, weights, route_map, feature_key_offset, world, report, layout,
                                   feature_units)
    out = torch.ops.torchrec_hybrid.split_pack(values, lengths, weights, route_map, feature_key_offset, world,
                                               report, layout.rooms, feature_units)
    send_rows, payload, stats, cells, counts, hot_rows, hot_offsets, hot_weights = out
    return SplitPack(send_rows, payload, stats, cells, counts, hot_rows, hot_offsets,
                     hot_weights if weights is not None else None)


def exchange_summary(rows_in: torch.Tensor, layout: ExchangeLayout, num_features: int,
                     feature_units: Optional[torch.Tensor], stats: torch.Tensor) -> torch.Tensor:
    """:func:`composed.exchange_summary`."""
    if not fused_on(rows_in):
        return composed.exchange_summary(rows_in, layout, num_features, feature_units, stats)
    return torch.ops.torchrec_hybrid.exchange_summary(rows_in, layout.recv_at, layout.head, num_features,
                                                      feature_units, stats)


def unpack_cold(rows_in: torch.Tensor, rest_in: torch.Tensor, layout: ExchangeLayout, runs: List[int],
                num_features: int, weighted: bool, lanes: LaneLayout, batches: List[int], extra_features: torch.Tensor,
                extra_rows: torch.Tensor, extra_per_feature: List[int], return_units: List[int],
                feature_bags: List[int], feature_ids: List[int]) -> ColdUnpacked:
    """:func:`composed.unpack_cold`."""
    if not fused_on(rows_in):
        return composed.unpack_cold(rows_in, rest_in, layout, runs, num_features, weighted, lanes, batches,
                                    extra_features, extra_rows, extra_per_feature, return_units, feature_bags,
                                    feature_ids)
    out = torch.ops.torchrec_hybrid.unpack_cold(
        rows_in, rest_in, layout.recv_at, layout.recv_rooms, layout.head, runs, num_features, weighted,
        lanes.feature_table, lanes.lane_table, batches, extra_features, extra_rows.to(torch.int32), return_units)
    lengths, ids, weights, send_index, source, row_pos, row_dst = out
    return ColdUnpacked(lengths, ids, weights if weighted else None, send_index, source, row_pos, row_dst)


def receive_plan(sent_cells: torch.Tensor, cells: CellPositions, partial_units: List[int],
                 replica_units: List[int], replica_order: torch.Tensor, pooled_units: int) -> Received:
    """:func:`composed.receive_plan`."""
    if not fused_on(sent_cells):
        return composed.receive_plan(sent_cells, cells, partial_units, replica_units, replica_order, pooled_units)
    recv_pos, row_src, replica_src = torch.ops.torchrec_hybrid.receive_plan(
        sent_cells, cells.num_features, cells.fused_table, cells.row_units, partial_units, replica_units,
        replica_order, pooled_units, composed.ZERO_SPREAD)
    return Received(recv_pos, row_src, replica_src if row_src.numel() else None)


class _HotPoolAdd(torch.autograd.Function):
    """:func:`composed.hot_pool_add` of one replica as one fused op each way: the pooling and the adds in
    one pass forward; backward, the replica's row gradients (summed per row, weighted) and the received
    units' (gathered at their positions) in another."""

    @staticmethod
    def forward(ctx, replica, recv, tables: Any, rows, offsets, weights, recv_pos, unit, batch):
        ctx.save_for_backward(rows, offsets, recv_pos, *(() if weights is None else (weights,)))
        ctx.tables, ctx.unit, ctx.replica_numel = tables, unit, replica.numel()
        return torch.ops.torchrec_hybrid.hot_pool(replica, tables.weights_offsets, tables.D_offsets, rows, offsets,
                                                  weights, recv, recv_pos, unit, batch)

    @staticmethod
    def backward(ctx, grad):
        rows, offsets, recv_pos, *weights = ctx.saved_tensors
        t = ctx.tables
        grad_replica, grad_recv = torch.ops.torchrec_hybrid.hot_pool_backward(
            grad, ctx.replica_numel, t.weights_offsets, t.D_offsets, rows, offsets, weights[0] if weights else None,
            recv_pos, ctx.unit)
        return grad_replica, grad_recv, None, None, None, None, None, None, None


def hot_pool_add(state: HotState, replica: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                 weights: Optional[torch.Tensor], batch: int, recv: torch.Tensor, recv_pos: torch.Tensor,
                 unit: int) -> torch.Tensor:
    """:func:`composed.hot_pool_add`, one op each way on the CPU where the sharding has one replica (one table
    group; FBGEMM's dense CPU kernel took about 3x the time of this pooling on the product's one-hot batch)."""
    if not fused_on(replica) or len(state.replicas) != 1:
        return composed.hot_pool_add(state, replica, rows, offsets, weights, batch, recv, recv_pos, unit)
    return _HotPoolAdd.apply(replica, recv, state.replicas[0].tbe, rows, offsets.to(rows.dtype), weights,
                             recv_pos, unit, batch)


def check_ids(values: torch.Tensor, limit_per_key: torch.Tensor, counts: List[int], feature_of_key: torch.Tensor,
              weights: Optional[torch.Tensor], check_weights: bool):
    """The sharded module's check of a batch's ids (and, ``check_weights``, float32 weights) on the CPU, in one
    pass: ``(code, ids, weights)`` - code 1 (an id of a key that is a feature outside ``[0, its limit]``), else
    2 (a non-finite weight), else 0, as an int64 scalar tensor; ids and weights as given when all are fine,
    else copies with the bad ids clamped into range and the bad weights zeroed (sharded_ebc.py composes the
    same from torch ops on other devices)."""
    code, fixed_values, fixed_weights = torch.ops.torchrec_hybrid.check_ids(
        values, limit_per_key, counts, feature_of_key, weights if check_weights else None)
    ids = fixed_values if fixed_values.numel() else values
    return code.view(()), ids, fixed_weights if fixed_weights.numel() else weights
