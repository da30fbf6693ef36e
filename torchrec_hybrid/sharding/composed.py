"""The hot path's four fused steps, composed from torch and FBGEMM ops: the reference and fallback.

Each function here is one step of a training step's index work, with the same arguments and
results as the fused op of that name (``csrc/hybrid_ops.cpp``, loaded by ``fused.py``):

- :func:`split_pack` (sample side, before the cold exchange): route every id to its owner or
  the local replica, bucketize, keep the non-empty cold bags and pack each destination's
  header and run into the exchange's send rows;
- :func:`exchange_summary` (after it lands): every size the host needs, in one small tensor
  (its ``tolist`` is the step's one host sync);
- :func:`unpack_cold` (owner side): the received runs and the owner's hot rows as the lanes'
  TBE inputs, and where each bag's partial sum goes in the output all-to-all's send buffer;
- :func:`receive_plan` (sample side): where each unit the output all-to-all brings adds in.

Every shape here is known on the host before any data is read (the cold exchange's one sync
gives the sizes), so on a GPU this path launches kernels but never waits for the device. The
fused CPU ops do the same work in one pass each; tests hold the two to identical results.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from torchrec_hybrid import row_blocks
from torchrec_hybrid.sharding.cells import CellPositions, LaneLayout
from torchrec_hybrid.sharding.hot_state import HotState
from torchrec_hybrid.sharding.segments import (cached_tensor, exclusive_cumsum, host_segment_positions,
                                               host_to_device, round_robin_order, segment_arange,
                                               segment_positions, starts)

ZERO_SPREAD = 256  # output units the received hot rows' zeros are added to, round robin (receive_plan)


class SplitPack(NamedTuple):
    """What :func:`split_pack` makes of one rank's batch.

    send_rows: int32, per destination its header (``[bags per feature, ids per feature,
        report words, over]``) then its room: the run's first words (zeros past the run).
    payload: int32, per destination its run - the non-empty bags' lengths, then their ids
        (rows on the owner), then their weights' bits, each in (feature, sample) order -
        destination after destination, then words never sent: where a run that outgrew its
        room continues (:func:`spill_words`).
    stats: int64 ``[3, W]``: per destination its run's words, the output units of its bags
        (``feature_units``) and its bags.
    sent_cells: int64, the bags sent, in (destination, feature, sample) order, as cells
        ``sample * F + feature`` (the first ``stats[2].sum()`` are read).
    sent_counts: int64 ``[W, F]``: bags sent per destination and feature.
    hot_rows / hot_offsets / hot_weights: the hot lookups as the replica TBE's input: rows of
        their feature's replica table, jagged by (feature, sample) through ``hot_offsets``
        (``[F * B + 1]``, which may start past 0: only the rows it spans are read).
    """

    send_rows: torch.Tensor
    payload: torch.Tensor
    stats: torch.Tensor
    sent_cells: torch.Tensor
    sent_counts: torch.Tensor
    hot_rows: torch.Tensor
    hot_offsets: torch.Tensor
    hot_weights: Optional[torch.Tensor]


class ColdUnpacked(NamedTuple):
    """What :func:`unpack_cold` makes of the received runs (owner side).

    lengths / ids / weights: the lanes' TBE input, lane after lane (cells.LaneLayout): lengths
        ``[slots_g, batch_g]`` zero-padded; ids (and weights) per feature in lane order: the
        sources' runs in rank order, then its extra one-id bags (the owned hot rows).
    send_index: per destination, the output units of the bags it sent here (arrival order), then of
        every owned hot row: the output all-to-all's send buffer as positions in the lanes'
        concatenated output.
    source: per unit of that output, the send position its gradient comes from (0: none).
    row_pos: the owned hot rows' units in that output; row_dst: their W copies' send positions.
    """

    lengths: torch.Tensor
    ids: torch.Tensor
    weights: Optional[torch.Tensor]
    send_index: torch.Tensor
    source: torch.Tensor
    row_pos: torch.Tensor
    row_dst: torch.Tensor


class Received(NamedTuple):
    """Where each unit the output all-to-all brings goes (sample side, :func:`receive_plan`).

    recv_pos: per received unit, its place in the pooled output (a hot row's: any place, it
        adds zeros); row_src: the received hot units' positions in the buffer, owner after
        owner; replica_src: per replica unit, the received unit it copies (None: none arrived).
    """

    recv_pos: torch.Tensor
    row_src: torch.Tensor
    replica_src: Optional[torch.Tensor]


class ExchangeLayout(NamedTuple):
    """The cold exchange's rooms for one step: host ints, and the reference's index tensors built once.

    rooms / recv_rooms: payload words the send rows hold per destination / the received rows per
    source; head: header words; recv_at: where each source's header starts in the received rows;
    send_dest / send_offset / send_is_room: per send word, its destination, its offset in the
    header or the room, and which of the two; recv_heads: the received headers' word positions.
    """

    rooms: List[int]
    recv_rooms: List[int]
    head: int
    recv_at: List[int]
    send_dest: torch.Tensor
    send_offset: torch.Tensor
    send_is_room: torch.Tensor
    recv_heads: torch.Tensor

    @property
    def send_rows(self) -> List[int]:
        """Per destination the header, then the room: the all-to-all's send split sizes."""
        return [self.head + r for r in self.rooms]

    @property
    def recv_rows(self) -> List[int]:
        return [self.head + r for r in self.recv_rooms]


def exchange_layout(rooms: List[int], recv_rooms: List[int], head: int, device: torch.device) -> ExchangeLayout:
    """The layout of an exchange with these rooms (set up when the rooms change, not per step)."""
    W = len(rooms)
    sizes = [n for r in rooms for n in (head, r)]
    sizes_t = host_to_device(sizes, device)
    total = sum(sizes)
    segment = torch.repeat_interleave(torch.arange(2 * W, device=device), sizes_t, output_size=total)
    recv_at = starts([head + r for r in recv_rooms])
    return ExchangeLayout(rooms, recv_rooms, head, recv_at, torch.div(segment, 2, rounding_mode="floor"),
                          segment_arange(sizes_t, total), segment % 2 == 1,
                          host_segment_positions(recv_at, [head] * W, device))


def _bag_cells(W: int, F: int, B: int, device: torch.device) -> torch.Tensor:
    """Each (owner, feature, sample) bag's cell ``sample * F + feature``."""
    index = torch.arange(W * F * B, device=device)
    group = torch.div(index, max(B, 1), rounding_mode="floor")  # owner * F + feature
    return (index - group * B) * F + group % max(F, 1)


def route(values: torch.Tensor, lengths: torch.Tensor, route_map: torch.Tensor,
          feature_key_offset: torch.Tensor) -> torch.Tensor:
    """Per id, the id the bucketization decodes (row_blocks.bucket_ids): one gather in the dense key map."""
    F = feature_key_offset.numel()
    per_feature = lengths.view(F, -1).sum(1)
    keys = torch.repeat_interleave(feature_key_offset, per_feature, output_size=values.numel()).add_(values)
    return route_map.index_select(0, keys)


def split_pack(values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor],
               route_map: Optional[torch.Tensor], feature_key_offset: torch.Tensor, world: int,
               report: torch.Tensor, layout: ExchangeLayout, feature_units: Optional[torch.Tensor]) -> SplitPack:
    """One rank's batch split into hot lookups and the cold exchange's send rows.

    values / lengths / weights: the hybrid features' ids (int32 / int64), bag lengths
    ``[F * B]`` and float32 weights (or None). route_map: the dense key map (per key the
    bucketized id, row_blocks.bucket_ids), or None when ``values`` are bucketized ids already.
    report: int32 words every rank receives (``[R]``, R may be 0). layout: this step's rooms.
    feature_units: per feature, output units of one bag (None: 1 each).
    """
    W, F = world, feature_key_offset.numel()
    B = lengths.numel() // F if F else 0
    routed = values if route_map is None else route(values, lengths, route_map, feature_key_offset)
    bucket_lengths, rows, row_weights = row_blocks.bucketize(lengths, routed, W, weights)
    n = W * F * B
    sent = bucket_lengths[:n]
    nonempty = sent > 0
    bag_counts = nonempty.view(W * F, B).sum(1)
    id_counts = sent.view(W * F, B).sum(1).to(torch.int64)
    # a non-empty bag goes to its rank among them; every empty one to a spare last place
    target = torch.where(nonempty, torch.cumsum(nonempty, 0) - 1, n)
    sent_lengths = sent.new_empty(n + 1).scatter_(0, target, sent)[:n]
    sent_cells = torch.empty(n + 1, dtype=torch.int64, device=sent.device).scatter_(
        0, target, _bag_cells(W, F, B, sent.device))[:n]
    hot_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(bucket_lengths)[n:]
    weighted = weights is not None
    parts = 3 if weighted else 2
    per_dest = torch.stack([bag_counts, id_counts]).view(2, W, F).sum(2)  # [2, W]: bags, ids
    words = per_dest[0] + (parts - 1) * per_dest[1]
    head = layout.head
    over = (words > host_to_device(layout.rooms, words.device)).any()
    header = [bag_counts.view(W, F), id_counts.view(W, F), report.view(1, -1).to(torch.int64).expand(W, -1),
              over.to(torch.int64).view(1, 1).expand(W, 1)]
    meta = torch.cat(header, 1).to(torch.int32)
    assert meta.size(1) == head, (meta.size(1), head)
    # the payload: per destination its lengths, ids, weights' bits (one FBGEMM segment permute)
    buffers = host_to_device([n, rows.numel()], sent.device)
    sizes = torch.cat([per_dest, (buffers - per_dest.sum(1)).view(2, 1)], 1)  # [part, W + 1]
    values_ = [sent_lengths.to(torch.int32), rows.to(torch.int32)]
    if row_weights is not None:
        sizes = torch.cat([sizes, sizes[1:]])
        values_.append(row_weights.to(torch.float32).view(torch.int32))
    flat = torch.cat(values_)
    _, payload, _ = torch.ops.fbgemm.permute_1D_sparse_data(
        round_robin_order(parts, W + 1, sent.device), sizes.reshape(-1).to(torch.int32), flat, None, flat.numel())
    units = per_dest[0] if feature_units is None else (bag_counts.view(W, F) * feature_units).sum(1)
    stats = torch.stack([words, units, per_dest[0]])
    # send rows: per destination its header, then its room filled from its run (zeros past the run)
    zero = meta.numel() + payload.numel()
    source = torch.cat([meta.view(-1), payload, payload.new_zeros(1)])
    dest, offset = layout.send_dest, layout.send_offset
    run_word = (exclusive_cumsum(words) + meta.numel()).index_select(0, dest) + offset
    room_word = torch.where(offset < words.index_select(0, dest), run_word, zero)
    send_rows = source.index_select(0, torch.where(layout.send_is_room, room_word, dest * head + offset))
    return SplitPack(send_rows, payload, stats, sent_cells, bag_counts.view(W, F).to(torch.int64), rows,
                     hot_offsets, row_weights)


def spill_words(payload: torch.Tensor, words: List[int], rooms: List[int]) -> torch.Tensor:
    """Per destination the words of its run past its room (host ints: after the exchange's sync)."""
    over = [max(0, n - r) for n, r in zip(words, rooms)]
    at = [a + r for a, r in zip(starts(words), rooms)]
    return payload.index_select(0, host_segment_positions(at, over, payload.device))


def exchange_summary(rows_in: torch.Tensor, layout: ExchangeLayout, num_features: int,
                     feature_units: Optional[torch.Tensor], stats: torch.Tensor) -> torch.Tensor:
    """Every size the host needs after the exchange, int64: ``stats`` (``[3, W]``, this rank's
    sends), per source its bags and ids (interleaved) and the output units of its bags, per
    feature the bags and the ids received, whether some source's run outgrew its room, and
    every source's report words."""
    F, W = num_features, len(layout.recv_at)
    heads = rows_in.index_select(0, layout.recv_heads).view(W, layout.head).to(torch.int64)
    counts = heads[:, :2 * F].view(W, 2, F)
    units = counts[:, 0].sum(1) if feature_units is None else (counts[:, 0] * feature_units).sum(1)
    return torch.cat([stats.reshape(-1), counts.sum(2).view(-1), units, counts.sum(0).view(-1),
                      heads[:, -1].max().view(1) if W else heads.new_zeros(1), heads[:, 2 * F:-1].reshape(-1)])


def received_runs(rows_in: torch.Tensor, rest_in: torch.Tensor, layout: ExchangeLayout,
                  runs: List[int]) -> torch.Tensor:
    """Every source's run, back to back: its room's first words in ``rows_in``, the rest (spilled) in ``rest_in``."""
    cut = [min(n, r) for n, r in zip(runs, layout.recv_rooms)]
    rest_at = starts([n - c for n, c in zip(runs, cut)])
    bases = [x for a, b in zip(layout.recv_at, rest_at) for x in (a + layout.head, rows_in.numel() + b)]
    pieces = [x for c, n in zip(cut, runs) for x in (c, n - c)]
    both = rows_in if rest_in.numel() == 0 else torch.cat([rows_in, rest_in])
    return both.index_select(0, host_segment_positions(bases, pieces, rows_in.device))


def unpack_cold(rows_in: torch.Tensor, rest_in: torch.Tensor, layout: ExchangeLayout, runs: List[int],
                num_features: int, weighted: bool, lanes: LaneLayout, batches: List[int], extra_features: torch.Tensor,
                extra_rows: torch.Tensor, extra_per_feature: List[int], return_units: List[int],
                feature_bags: List[int], feature_ids: List[int]) -> ColdUnpacked:
    """The owner's lane inputs and output send plan from the received runs (``runs``: words per source).

    Feature f's bags are the received ones, sources in rank order, then its extra one-id bags
    (``extra_rows`` of ``extra_features``, sorted by feature); ``batches``: each lane's batch
    (cells.LaneLayout.batches of the bags per feature); ``return_units``: per source, the output
    units of the bags it sent here; ``feature_bags`` / ``feature_ids``: bags and ids received per
    feature (host ints from :func:`exchange_summary`).
    """
    F, W = num_features, len(runs)
    parts = 3 if weighted else 2
    payload = received_runs(rows_in, rest_in, layout, runs)
    counts = rows_in.index_select(0, layout.recv_heads).view(W, layout.head)[:, :2 * F]  # per source bags, ids
    words = torch.cat([counts, counts[:, F:]], 1) if weighted else counts
    E = extra_rows.numel()
    per_feature = host_to_device(extra_per_feature, rows_in.device)
    ones = torch.ones(E, dtype=torch.int32, device=rows_in.device)
    extra_values = [ones, extra_rows.to(torch.int32)] + ([ones.to(torch.float32).view(torch.int32)] if weighted else [])
    sizes = torch.cat([words.reshape(-1).to(torch.int64), per_feature.repeat(parts)])
    values = torch.cat([payload] + extra_values)
    _, data, _ = torch.ops.fbgemm.permute_1D_sparse_data(lanes.receive_order(W, parts), sizes.to(torch.int32),
                                                         values, None, values.numel())
    bag_counts = counts[:, :F].to(torch.int64)
    received = bag_counts.sum(0)
    host_ids = [n + e for n, e in zip(feature_ids, extra_per_feature)]
    host_bags = [n + e for n, e in zip(feature_bags, extra_per_feature)]
    n_bags, n_ids = sum(host_bags[f] for f in lanes.order), sum(host_ids[f] for f in lanes.order)
    padded = lanes.lengths_positions(host_bags, batches, rows_in.device)
    total_lengths = sum(s * b for s, b in zip(lanes.lane_slots, batches))
    lengths = data.new_zeros(total_lengths).scatter_(0, padded, data[:n_bags])
    ids = data[n_bags:n_bags + n_ids]
    weights = data[n_bags + n_ids:].view(torch.float32) if weighted else None
    # the received bags in arrival order (source, feature, sample) as (row q, feature), then the extra bags
    n_received = sum(feature_bags)
    size = bag_counts.reshape(-1)
    run_feature = cached_tensor(tuple(range(F)) * W, torch.int64, rows_in.device)
    q = segment_positions(exclusive_cumsum(bag_counts, 0).reshape(-1), size, n_received)
    feature = torch.repeat_interleave(run_feature, size, output_size=n_received)
    extra_rank = torch.arange(E, device=rows_in.device) - exclusive_cumsum(per_feature).index_select(0, extra_features)
    row_q = received.index_select(0, extra_features) + extra_rank
    bag_units = n_received if lanes.one_unit else sum(return_units)
    pos = lanes.positions(torch.cat([q, row_q]), torch.cat([feature, extra_features]), batches,
                          bag_units + lanes.units_of(extra_per_feature))
    bag_pos, row_pos = pos[:bag_units], pos[bag_units:]
    # the output all-to-all's send buffer: per destination its bags' units, then every owned hot row's
    n_rows = row_pos.numel()
    at = starts([n for u in return_units for n in (u, n_rows)])
    both = host_segment_positions(at[0::2] + at[1::2], list(return_units) + [n_rows] * W, rows_in.device)
    bag_dst, row_dst = both[:bag_units], both[bag_units:]
    index = torch.empty(bag_units + W * n_rows, dtype=torch.int64, device=rows_in.device)
    index.scatter_(0, bag_dst, bag_pos).scatter_(0, row_dst, row_pos.repeat(W))
    cold_units = sum(b * u for b, u in zip(batches, lanes.lane_units))
    source = torch.zeros(cold_units, dtype=torch.int64, device=rows_in.device).scatter_(0, bag_pos, bag_dst)
    return ColdUnpacked(lengths, ids, weights, index, source, row_pos, row_dst)


def receive_plan(sent_cells: torch.Tensor, cells: CellPositions, partial_units: List[int],
                 replica_units: List[int], replica_order: torch.Tensor, pooled_units: int) -> Received:
    """Sample side: from each owner the partial sums of the bags sent it (``sent_cells``, the order
    they were sent in), then its hot rows: where each unit adds in, and the replica's sources."""
    n_partial = sum(partial_units)
    part_pos = cells(sent_cells, n_partial)
    at = starts([n for pair in zip(partial_units, replica_units) for n in pair])
    both = host_segment_positions(at[0::2] + at[1::2], list(partial_units) + list(replica_units), sent_cells.device)
    part_src, row_src = both[:n_partial], both[n_partial:]
    replica_src = row_src.index_select(0, replica_order) if row_src.numel() else None
    recv_units = n_partial + sum(replica_units)
    spread = torch.arange(recv_units, device=sent_cells.device) % max(1, min(pooled_units, ZERO_SPREAD))
    return Received(spread.scatter_(0, part_src, part_pos), row_src, replica_src)


class AddPartials(torch.autograd.Function):
    """``hot`` += each received unit at its position, in place (hot is a fresh, private tensor; the received
    hot-row units are zeros, output_dist's ``_AllToAllWait``).

    Spares the copy of an out-of-place ``index_add`` and, unlike an in-place op on a view,
    autograd's CopySlices machinery, which clones the whole gradient.
    """

    @staticmethod
    def forward(ctx, hot, received, positions, width):
        ctx.save_for_backward(positions)
        ctx.width = width
        hot.view(-1, width).index_add_(0, positions, received.view(-1, width))
        ctx.mark_dirty(hot)
        return hot

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        return grad, grad.reshape(-1, ctx.width).index_select(0, positions).view(-1), None, None


def hot_pool_add(state: HotState, replica: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                 weights: Optional[torch.Tensor], batch: int, recv: torch.Tensor, recv_pos: torch.Tensor,
                 unit: int) -> torch.Tensor:
    """Sample side: the hot lookups pooled from ``replica`` (FBGEMM's dense TBE per group, hot_state.HotState.pool)
    plus every received unit (``recv``, units of ``unit`` elements) added at its position ``recv_pos``:
    the pooled ``[batch, sum(dims)]``, differentiable in ``replica`` and ``recv``."""
    pooled = state.pool(replica, rows, offsets, weights, batch)
    if recv_pos.numel() == 0:
        return pooled
    return AddPartials.apply(pooled, recv, recv_pos, unit)
