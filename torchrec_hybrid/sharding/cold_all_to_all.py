"""The cold ids' trip to their owners: one all-to-all per step, two on the first.

Wire format, per (source, destination) pair, all int32 (gloo and NCCL carry it as is):

- header ``[2F + R + 1]``: how many non-empty bags per feature, how many ids per feature, then
  ``R`` words every rank must see (the sharded module's id-check report; ``R = 0`` when the
  call carries none - every rank's call must agree), then whether the source's run to some
  peer exceeded its room (below);
- payload: the bags' lengths, then their ids (the owner's local rows), then, for weighted
  features, the weights' bits, each in (feature, sample) order.

An all-to-all needs its split sizes on both ends before it starts, and a payload's size is
known to its receiver only from the header. The first exchange sends the headers alone, syncs
their sizes to the host and sends the payloads (two collectives). After it, every pair of ranks
knows what the pair sent last time - the source sent it, the destination received it - so each
exchange sends header and payload in one all-to-all, each pair given a room sized from what it
sent before (:func:`next_room`: kept while the runs fit it and it is at most twice a fresh room, else 1.15x the
run plus 128 words; the room is sent whole, the margin is the bytes it costs, and rooms that
stay put keep their gathers' index tensors). A run longer than its room sends the room's worth, and its source raises
the flag every rank receives: after the host sync every rank then knows, and the words past the
rooms follow in a second all-to-all (``spills`` counts those steps). Per step that is one
collective where TorchRec's ``KJTAllToAll`` of the same variable-batch KJT takes four (splits,
lengths, values, batch sizes per key, plus a recat permute and per-key sums on the receiver),
and one host sync either way. On the 4-rank gloo box (2 cores) a small all-to-all costs 1-3 ms
alone (``benchmarks/results/comm_floor.md``). The receiver turns the payload into the owner's
lookup input with one FBGEMM segment permute (:meth:`ColdBags.lane_inputs`).
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid._compat import Deferred
from torchrec_hybrid.sharding.cells import LaneLayout
from torchrec_hybrid.sharding.segments import (cached_tensor, exclusive_cumsum, host_segment_positions, host_to_device,
                                               round_robin_order, segment_arange, segment_positions, starts)


class ExtraBags:
    """An owner's hot rows as extra one-id bags of its cold lookup (so the fused optimizer updates them and
    they can be sent to every replica): their features (sorted) and rows, and what every step reuses - per
    feature their count (device and host), each one's rank among its feature's, and their part of the lookup
    input's segment sizes and values (:meth:`tail`). Built once per hot set (the same every step when every
    hot row travels)."""

    def __init__(self, features: torch.Tensor, rows: torch.Tensor, num_features: int) -> None:
        self.features, self.rows = features, rows.to(torch.int32)
        self.per_feature = torch.bincount(features, minlength=num_features)
        self.host_per_feature = self.per_feature.tolist()
        # rank of each extra bag within its feature's extra bags
        self.rank = torch.arange(rows.numel(), device=rows.device) - exclusive_cumsum(self.per_feature)[features]
        self.ones = torch.ones(rows.numel(), dtype=torch.int32, device=rows.device)
        self._tails: dict = {}

    def tail(self, parts: int):
        """Their runs' sizes per (part, feature) and their words - lengths (ones), rows, and for weighted
        features the weights' bits (ones) - as int32, appended after what arrived (cached per part count)."""
        if parts not in self._tails:
            values = [self.ones, self.rows] + ([self.ones.to(torch.float32).view(torch.int32)] if parts == 3 else [])
            self._tails[parts] = (torch.cat([self.per_feature] * parts).to(torch.int32), torch.cat(values))
        return self._tails[parts]


@dataclass
class ColdBags:
    """What an owner received in one step: the payload and, per source rank, its metadata.

    bag_counts / id_counts: how many non-empty bags and ids per ``[source, feature]`` (int64); host_feature_bags /
    host_feature_ids: their per-feature totals over the sources, on the host (from the
    split-size sync that precedes the payload); reports / host_reports: the ``R`` extra
    metadata words per source (int32 ``[W, R]``, and as one flat host list), or None.
    host_return_units / host_partial_units: the output all-to-all's split sizes, per rank:
    the units of partial sums this rank returns to it (its bags received here), and that it
    returns to this rank (this rank's bags sent there) - known here, so the output dist
    needs no host sync of its own. host_sent_bags: how many bags this rank sent in all.
    """

    payload: torch.Tensor
    bag_counts: torch.Tensor
    id_counts: torch.Tensor
    counts_words: torch.Tensor  # int32 [W, 2F]: per source its bags, then its ids, per feature (the header's words)
    host_feature_bags: List[int]
    host_feature_ids: List[int]
    weighted: bool
    reports: Optional[torch.Tensor]
    host_reports: Optional[List[int]] = None
    host_return_units: Optional[List[int]] = None
    host_partial_units: Optional[List[int]] = None
    host_sent_bags: int = 0

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.payload, self.bag_counts, self.id_counts, self.counts_words, self.reports):
            if t is not None:
                t.record_stream(stream)

    def lane_inputs(self, lanes: LaneLayout, keys: List[List[str]], extra: ExtraBags):
        """The received bags plus the extra one-id bags per feature as one fixed-batch KJT per lane.

        Feature f's bags are the received ones, sources in rank order, then its extra bags
        (:class:`ExtraBags`, sorted by feature); each lane's batch is its largest bag count per slot
        (cells.LaneLayout; FBGEMM's CPU variable-batch kernel is far slower than padding). ``keys``: the
        lanes' slot names. Needs no host sync: the counts came with the split sizes. Returns the KJTs, the
        lanes' batches, the rows (bags) received per feature, and the received bags in arrival order -
        (source, feature, sample), the order they travel home in - as (row q, feature).
        """
        W, F = self.bag_counts.shape
        data = self._permuted_payload(lanes, W, F, extra)
        host_rows, host_ids, host_bags, batches = self._host_sizes(lanes, F, extra.host_per_feature)
        n_bags, n_ids = sum(host_bags), sum(host_ids)
        rows_per_feature = self.bag_counts.sum(0)
        lengths = _padded_lengths(lanes, host_bags, data, n_bags, batches)
        kjts = _lane_kjts(lanes, keys, batches, host_ids, lengths, data, n_bags, n_ids, self.weighted)
        return kjts, batches, rows_per_feature, self._arrival_order(W, F, sum(host_rows))

    def _permuted_payload(self, lanes: LaneLayout, W: int, F: int, extra: ExtraBags) -> torch.Tensor:
        """The payload with the extra bags' parts appended, in lane order by one FBGEMM segment permute: all
        bag lengths, then all ids, then all weights' bits (per feature the sources' runs, then its extras)."""
        parts = 3 if self.weighted else 2
        words = self.counts_words  # per source: bags, ids (the weights' runs are as long as the ids')
        if self.weighted:
            words = torch.cat([words, words[:, F:]], 1)
        extra_sizes, extra_values = extra.tail(parts)
        sizes = torch.cat([words.reshape(-1), extra_sizes])
        values = torch.cat([self.payload, extra_values])
        order = lanes.receive_order(W, parts)
        _, data, _ = torch.ops.fbgemm.permute_1D_sparse_data(order, sizes, values, None, values.numel())
        return data

    def _host_sizes(self, lanes: LaneLayout, F: int, host_extra: List[int]):
        """Host lists, per feature: bags received, ids (extras included) and bags (extras included); and each
        lane's batch (cells.LaneLayout.batches). From the split-size copies: no sync."""
        host_rows = self.host_feature_bags
        host_ids = [n + e for n, e in zip(self.host_feature_ids, host_extra)]
        host_bags = [n + e for n, e in zip(host_rows, host_extra)]
        return host_rows, host_ids, host_bags, lanes.batches(host_bags)

    def _arrival_order(self, W: int, F: int, n_received: int):
        """The received bags in arrival order - (source, feature, sample), the order they travel home in - as
        (row q, feature): run (s, f) of the arrival order holds bags first[s, f] ... of feature f."""
        size = self.bag_counts.view(-1)
        run_feature = cached_tensor(tuple(range(F)) * W, torch.int64, size.device)  # each run's feature
        arrival_feature = torch.repeat_interleave(run_feature, size, output_size=n_received)
        arrival_q = segment_positions(exclusive_cumsum(self.bag_counts, 0).view(-1), size, n_received)
        return arrival_q, arrival_feature


def _padded_lengths(lanes: LaneLayout, host_bags: List[int], data: torch.Tensor, n_bags: int,
                    batches: List[int]) -> torch.Tensor:
    """The lanes' lengths, ``[slots_g, batch_g]`` lane after lane: the bag lengths (the first ``n_bags`` of
    ``data``, lane order) scattered to their (feature, row q) slots, zeros padding each lane to its batch (each
    feature's bags, ``host_bags``, follow on from its first slot: one segment gather sized on the host)."""
    padded = lanes.lengths_positions(host_bags, batches, data.device)
    lengths = data.new_zeros(sum(n * b for n, b in zip(lanes.lane_slots, batches)))
    return lengths.scatter_(0, padded, data[:n_bags])  # 1-D: scatter_ beats index_copy_ on CPU


def _lane_kjts(lanes: LaneLayout, keys: List[List[str]], batches: List[int], host_ids: List[int],
               lengths: torch.Tensor, data: torch.Tensor, n_bags: int, n_ids: int,
               weighted: bool) -> List[KeyedJaggedTensor]:
    """One fixed-batch KJT per lane: views of the ids (and weights) after the ``n_bags`` lengths in ``data``
    and of the padded ``lengths``, with the host-known ids per key where every key is a feature (a virtual
    feature's share of its feature's ids is not known on the host, and the lookup never asks; no sync)."""
    ids_data = data[n_bags:n_bags + n_ids]
    weights = data[n_bags + n_ids:].view(torch.float32) if weighted else None
    kjts, len0, id0 = [], 0, 0
    for fs, names, batch, slots in zip(lanes.lane_features, keys, batches, lanes.lane_slots):  # per lane (group)
        lpk = [host_ids[f] for f in fs]
        n = sum(lpk)
        kjts.append(KeyedJaggedTensor(
            keys=names, values=ids_data[id0:id0 + n], lengths=lengths[len0:len0 + slots * batch],
            weights=None if weights is None else weights[id0:id0 + n], stride=batch,
            length_per_key=lpk if slots == len(fs) else None))
        len0, id0 = len0 + slots * batch, id0 + n
    return kjts


# The fused exchange's room for the payload of each (source, destination) pair, in int32 words. Both ends of a
# pair know what it sent in the previous exchange (one sent it, the other received it) and decide alike: a
# pair keeps its room while the run fits it with ROOM_MIN_SLACK to spare and the room is at most twice a fresh one, else
# gets ``room_for(run)``: ROOM_SLACK times the run plus ROOM_PAD. Rooms that stay put keep the send and
# receive gathers' index tensors of the exchange (:class:`Rooms`) from one step to the next.
ROOM_SLACK = 1.15
ROOM_MIN_SLACK = 1.02
ROOM_PAD = 128


def room_for(run: int) -> int:
    """Payload words a pair gets when its room is (re)sized after an exchange where it sent ``run`` words."""
    return int(run * ROOM_SLACK) + ROOM_PAD


def next_room(room: Optional[int], run: int) -> int:
    """The pair's room for the next exchange after one where it had ``room`` (None: none yet) and sent ``run``."""
    if room is not None and run * ROOM_MIN_SLACK <= room <= 2 * room_for(run):
        return room
    return room_for(run)


@dataclass
class Rooms:
    """The fused exchange's payload room per pair, in words - per destination (what this rank may send each
    peer) and per source (what each peer may send here) - and, built once per set of rooms, the device
    tensors of its gathers: the send buffer (per peer its header, then its room) and the headers' words in
    the received rows."""

    head: int  # the header's words (the exchange's report words decide it)
    send: List[int]
    recv: List[int]
    recv_at: List[int]  # where each source's header starts in the received rows
    send_dev: torch.Tensor  # the rooms per destination, on the device (this step's runs are compared with them)
    send_sizes: torch.Tensor  # [2W]: per destination its header, then its room
    send_local: torch.Tensor  # per word of the send buffer, its offset in its segment
    head_src: torch.Tensor  # [W]: where destination d's header starts in the send source (d * head)
    recv_heads: torch.Tensor  # positions of the received headers' words, source after source

    @classmethod
    def build(cls, head: int, send: List[int], recv: List[int], device: torch.device) -> "Rooms":
        W = len(send)
        sizes = host_to_device([n for r in send for n in (head, r)], device)
        recv_at = starts([head + r for r in recv])
        return cls(head, send, recv, recv_at, host_to_device(send, device), sizes,
                   segment_arange(sizes, W * head + sum(send)),
                   torch.arange(W, dtype=torch.int64, device=device) * head,
                   host_segment_positions(recv_at, [head] * W, device))

    @property
    def send_rows(self) -> List[int]:
        """Per peer the header, then the room: the fused all-to-all's send split sizes."""
        return [self.head + r for r in self.send]

    @property
    def recv_rows(self) -> List[int]:
        return [self.head + r for r in self.recv]


class ColdIdsAllToAll:
    """Sends each owner its cold bags (see the module docstring); two-stage awaitable.

    Args:
        pg: the sharding's process group.
        num_features: F, the features of the sharding.
        feature_units: per feature, the output dist's units of one partial sum (1 when every
            feature is one width: it moves rows; else the feature's width: it moves elements).
            The output all-to-all's split sizes are then computed in this exchange's host
            sync (:attr:`ColdBags.host_return_units`, :attr:`ColdBags.host_partial_units`).
    """

    def __init__(self, pg: dist.ProcessGroup, num_features: int, device: torch.device,
                 feature_units: Optional[List[int]] = None) -> None:
        self._pg, self._world = pg, pg.size()
        self._features = num_features
        # segments: W destinations then the padding, of each part (lengths, ids[, weights])
        self._send_order = {p: round_robin_order(p, self._world + 1, device) for p in (2, 3)}
        units = feature_units if feature_units is not None else [1] * num_features
        self._units = torch.tensor(units, dtype=torch.int64, device=device)
        self._one_unit = all(u == 1 for u in units)  # a bag's partial sum is one unit: units = bags
        # words per [bag, id] on the wire: a length per bag, an id (and a weight) per id
        self._part_words = {p: torch.tensor([[1], [p - 1]], dtype=torch.int64, device=device) for p in (2, 3)}
        # the next exchange's payload room per destination and per source (:class:`Rooms`); None until an
        # exchange has taught them (the first sends its headers alone)
        self.rooms: Optional[Rooms] = None
        self.spills = 0  # fused exchanges where some pair's run exceeded its room (each took a second all-to-all)

    def __call__(self, bag_counts: torch.Tensor, id_counts: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                 weights: Optional[torch.Tensor], report: Optional[torch.Tensor]) -> Awaitable[Awaitable[ColdBags]]:
        """Starts the exchange.

        bag_counts / id_counts: how many non-empty bags and ids per ``[destination, feature]``; lengths / rows /
        weights: those bags' lengths, ids and weights, in (destination, feature, sample)
        order, each possibly followed by padding that is not sent (buffers of a size known
        before the counts keep the caller free of host syncs); report: R int32 words for
        every rank (each rank's call passes the same R), or None (R = 0).
        """
        W, F = self._world, self._features
        weighted = weights is not None
        parts = 3 if weighted else 2
        # per destination [bags, ids] (int64 sums of the int32 counts), then what is not sent: the
        # buffers' padding; as segment sizes, part after part (lengths, ids[, weights' bits])
        per_dest = torch.stack([bag_counts, id_counts]).view(2, W, F).sum(2)  # [2, W]
        send_splits = (per_dest * self._part_words[parts]).sum(0)
        rooms = self.rooms if W > 1 else None
        head = 2 * F + (0 if report is None else report.numel()) + 1
        if rooms is not None and rooms.head != head:  # another header size than the rooms were made for
            rooms = None  # (the same on every rank: every rank passes report words, or none)
        # header: counts, the report words, and whether a run exceeds its room (every rank sees every rank's
        # flag, so all agree on a second all-to-all for the rest)
        header = [bag_counts.view(W, F), id_counts.view(W, F)]
        if report is not None:
            header.append(report.view(1, -1).expand(W, -1))
        over = (send_splits > rooms.send_dev).any() if rooms is not None else torch.zeros((), dtype=torch.bool,
                                                                                   device=send_splits.device)
        header.append(over.to(torch.int64).view(1, 1).expand(W, 1))
        meta = torch.cat(header, 1).to(torch.int32)
        buffers = host_to_device([lengths.numel(), rows.numel()], per_dest.device)
        sizes = torch.cat([per_dest, (buffers - per_dest.sum(1)).view(2, 1)], 1)  # [part, W + 1]
        if weighted:
            sizes = torch.cat([sizes, sizes[1:]])
        values = [lengths.to(torch.int32), rows.to(torch.int32)]
        if weights is not None:
            values.append(weights.to(torch.float32).view(torch.int32))
        flat = torch.cat(values)
        _, payload, _ = torch.ops.fbgemm.permute_1D_sparse_data(
            self._send_order[parts], sizes.reshape(-1).to(torch.int32), flat, None, flat.numel())
        # per destination the output dist's units of the bags sent (then, when a bag is several units, the bags)
        bags_per_dest = per_dest[0]
        sent_units = bags_per_dest if self._one_unit else torch.cat(
            [(bag_counts.view(W, F) * self._units).sum(1), bags_per_dest])
        if W == 1:
            return Deferred(lambda: Deferred(lambda: self._received(payload, meta, send_splits, sent_units,
                                                                    weighted, None)))
        if rooms is None:  # two all-to-alls: the metadata, whose sync sizes the payload's
            recv_meta = torch.empty_like(meta)
            meta_work = dist.all_to_all_single(recv_meta, meta, group=self._pg, async_op=True)

            def splits_ready() -> Awaitable[ColdBags]:
                meta_work.wait()
                return self._received(payload, recv_meta, send_splits, sent_units, weighted, "start")

            return Deferred(splits_ready)
        # one all-to-all: per peer the header, then its room, filled by one gather from the headers and the
        # payload: the run, cut at the room (the rest, if some run exceeded its room, follows in a second
        # all-to-all once every rank knows), or past its end other words (never read)
        source = torch.cat([meta.view(-1), payload])
        bases = torch.stack([rooms.head_src, exclusive_cumsum(send_splits) + W * head], 1).view(-1)
        total_out = sum(rooms.send_rows)
        index = torch.repeat_interleave(bases, rooms.send_sizes, output_size=total_out) + rooms.send_local
        rows_out = source.index_select(0, index.clamp_(max=source.numel() - 1))
        rows_in = payload.new_empty(sum(rooms.recv_rows))
        work = dist.all_to_all_single(rows_in, rows_out, rooms.recv_rows, rooms.send_rows, group=self._pg,
                                      async_op=True)

        def fused_ready() -> Awaitable[ColdBags]:
            work.wait()
            recv_meta = rows_in.index_select(0, rooms.recv_heads).view(W, head)
            return self._received(payload, recv_meta, send_splits, sent_units, weighted, "fused",
                                  rows=rows_in, rooms=rooms)

        return Deferred(fused_ready)

    def _received(self, payload: torch.Tensor, recv_meta: torch.Tensor, send_splits: torch.Tensor,
                  sent_units: torch.Tensor, weighted: bool, start: Optional[str],
                  rows: Optional[torch.Tensor] = None, rooms: Optional["Rooms"] = None):
        """The step's one host sync - every split size of the payload and of the output
        all-to-all, the counts the owner's padding needs, the reports, the overflow flags - then: the payload
        all-to-all (``start="start"``); the fused rows' payload, and the all-to-all of what did not fit when
        some run exceeded its room (``"fused"``); on one rank (None) the payload is what arrived. Either way
        the next fused exchange's rooms follow from this one's runs (:func:`next_room`)."""
        W, F = self._world, self._features
        head = recv_meta.size(1)
        # what this rank sent per peer (words, units) and every received header, in one copy to the host; the
        # per-source and per-feature sums over the headers (W * (2F + R + 1) ints) are the host's work
        counts = recv_meta[:, :2 * F].view(W, 2, F)  # per source [bags, ids] per feature (int32)
        # what this rank sent per peer (words, units), per source its [bags, ids] (and units), per feature the
        # sources' totals, whether some rank's run exceeded its room, the reports: summed on the device, in
        # one copy to the host
        units_in = [] if self._one_unit else [(counts[:, 0] * self._units).sum(1)]
        host = torch.cat([send_splits, sent_units, counts.sum(2).view(-1), *units_in, counts.sum(0).view(-1),
                          recv_meta[:, -1].max().view(1), recv_meta[:, 2 * F:-1].reshape(-1)]).tolist()
        at = W + sent_units.numel()
        send, sent, sent_bags = host[:W], host[W:2 * W], host[at - W:at]
        bags_in, ids_in = host[at:at + 2 * W:2], host[at + 1:at + 2 * W:2]
        at += 2 * W
        recv = [b + ((3 if weighted else 2) - 1) * n for b, n in zip(bags_in, ids_in)]
        return_units = bags_in if self._one_unit else host[at:at + W]
        at += 0 if self._one_unit else W
        split = dict(host_return_units=return_units, host_partial_units=sent, host_sent_bags=sum(sent_bags),
                     host_feature_bags=host[at:at + F], host_feature_ids=host[at + F:at + 2 * F])
        spilled = bool(host[at + 2 * F])  # some rank's run exceeded its room: every rank saw its flag
        reports = host[at + 2 * F + 1:] if head > 2 * F + 1 else None
        meta = recv_meta[:, :-1]
        if W > 1:
            kept = rooms if rooms is not None and rooms.head == head else None
            send_next = [next_room(None if kept is None else kept.send[d], n) for d, n in enumerate(send)]
            recv_next = [next_room(None if kept is None else kept.recv[q], n) for q, n in enumerate(recv)]
            self.rooms = kept if kept is not None and send_next == kept.send and recv_next == kept.recv else \
                Rooms.build(head, send_next, recv_next, send_splits.device)
        if start is None:
            return self._bags(payload[:send[0]], meta, weighted, reports, split)
        if start == "start":
            out = payload.new_empty(sum(recv))
            work = dist.all_to_all_single(out, payload[:sum(send)], recv, send, group=self._pg, async_op=True)

            def payload_ready() -> ColdBags:
                work.wait()
                return self._bags(out, meta, weighted, reports, split)

            return Deferred(payload_ready)
        assert rows is not None and rooms is not None
        # per source: its first ``min(run, room)`` words after its header, then (spilled) its rest after the rows
        cut = [min(n, r) for n, r in zip(recv, rooms.recv)]
        bases, pieces = [a + head for a in rooms.recv_at], cut
        rest: Optional[torch.Tensor] = None
        if spilled:  # every rank: the words past each pair's room, in one more all-to-all
            self.spills += 1
            over_send = [n - c for n, c in zip(send, (min(n, r) for n, r in zip(send, rooms.send)))]
            over_recv = [n - c for n, c in zip(recv, cut)]
            rest_index = host_segment_positions([a + r for a, r in zip(starts(send), rooms.send)], over_send,
                                                payload.device)
            rest = payload.new_empty(sum(over_recv))
            work = dist.all_to_all_single(rest, payload.index_select(0, rest_index), over_recv, over_send,
                                          group=self._pg, async_op=True)
            rest_at = [rows.numel() + a for a in starts(over_recv)]
            bases = [x for pair in zip(bases, rest_at) for x in pair]
            pieces = [x for pair in zip(cut, over_recv) for x in pair]
        index = host_segment_positions(bases, pieces, payload.device)

        def fused_payload() -> ColdBags:
            if rest is None:
                return self._bags(rows.index_select(0, index), meta, weighted, reports, split)
            work.wait()
            return self._bags(torch.cat([rows, rest]).index_select(0, index), meta, weighted, reports, split)

        return Deferred(fused_payload)

    def _bags(self, payload, meta, weighted, reports, split) -> ColdBags:
        F = self._features
        return ColdBags(payload=payload, bag_counts=meta[:, :F].to(torch.int64),
                        id_counts=meta[:, F:2 * F].to(torch.int64), counts_words=meta[:, :2 * F],
                        weighted=weighted, reports=meta[:, 2 * F:] if meta.size(1) > 2 * F else None,
                        host_reports=reports, **split)
