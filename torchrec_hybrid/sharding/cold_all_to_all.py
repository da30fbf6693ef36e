"""The cold ids' trip to their owners: one all-to-all per step (a second when a run outgrows its room).

Per (source, destination) pair a header ``[2F + R + 1]`` (bags and ids per feature, ``R``
words every rank must see, a spill flag) and a run (lengths, ids, weights' bits) in a *room*
sized from what the pair sent before (:func:`next_room`), so both ends know the split sizes
without a round trip; a run longer than its room spills into a second all-to-all after the
step's one host sync. Wire format: docs/architecture.md §4.

The index work on both ends is :mod:`fused`'s ops; this module holds the rooms and the
collectives. The input dist's splits awaitable waits for the all-to-all and calls
:meth:`ColdIdsAllToAll.received` (the sync), whose :class:`ColdTensorsAwaitable` waits for a
spill, if any, and unpacks the owner's lane inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_hybrid._compat import HybridAwaitable

from torchrec_hybrid.sharding import composed, fused
from torchrec_hybrid.sharding.composed import ExchangeLayout, SplitPack, exchange_layout
from torchrec_hybrid.types import ROOM_PAD, ROOM_SLACK

# A pair's room for the next exchange, in int32 words: kept while the run fits it with ROOM_MIN_SLACK to spare
# and the room is at most twice a fresh one, else ``room_for(run)``: ROOM_SLACK times the run plus ROOM_PAD.
ROOM_MIN_SLACK = 1.02


def room_for(run: int) -> int:
    """Payload words a pair gets when its room is (re)sized after an exchange where it sent ``run`` words."""
    return int(run * ROOM_SLACK) + ROOM_PAD


def next_room(room: Optional[int], run: int) -> int:
    """The pair's room for the next exchange after one where it had ``room`` (None: none yet) and sent ``run``."""
    if room is not None and run * ROOM_MIN_SLACK <= room <= 2 * room_for(run):
        return room
    return room_for(run)


@dataclass
class ExchangeSizes:
    """The host's view of one exchange, from its one sync (:func:`fused.exchange_summary`).

    send_words / sent_units / sent_bags: what this rank sent each destination (run words, output
    units of its bags, bags); recv_words / return_units: per source, its run's words and the
    output units of its bags; feature_bags / feature_ids: per feature, bags and ids received;
    spilled: some run outgrew its room (every rank saw the flag); reports: every source's report
    words (R per source, rank order), or None.
    """

    send_words: List[int]
    sent_units: List[int]
    sent_bags: List[int]
    recv_words: List[int]
    return_units: List[int]
    feature_bags: List[int]
    feature_ids: List[int]
    spilled: bool
    reports: Optional[List[int]]

    @classmethod
    def parse(cls, host: List[int], world: int, num_features: int, weighted: bool, report_words: int
              ) -> "ExchangeSizes":
        W, F = world, num_features
        bags_in, ids_in = host[3 * W:5 * W:2], host[3 * W + 1:5 * W:2]
        at = 6 * W + 2 * F
        return cls(host[:W], host[W:2 * W], host[2 * W:3 * W],
                   [b + (2 if weighted else 1) * n for b, n in zip(bags_in, ids_in)], host[5 * W:6 * W],
                   host[6 * W:6 * W + F], host[6 * W + F:at], bool(host[at]),
                   host[at + 1:at + 1 + W * report_words] if report_words else None)


@dataclass
class ColdExchange:
    """One step's cold exchange once its sizes are known: what arrived and where the words are."""

    rows_in: torch.Tensor  # per source its header, then its room
    rest_in: torch.Tensor  # the words past the rooms (a spill), source after source
    layout: ExchangeLayout
    sizes: ExchangeSizes
    pack: SplitPack  # what this rank sent (and keeps: its sample-side half of the step)


class ColdTensorsAwaitable(HybridAwaitable):
    """The exchange after its sync: the spill all-to-all in flight, if any; ``wait`` hands the
    :class:`ColdExchange` to ``finish`` (the input dist's unpacking) and returns what it makes."""

    def __init__(self, exchange: ColdExchange, work: Optional[dist.Work], finish: Callable) -> None:
        super().__init__()
        self._exchange, self._work, self._finish = exchange, work, finish

    def result(self):
        if self._work is not None:
            self._work.wait()
        return self._finish(self._exchange)


class ColdIdsAllToAll:
    """Sends each owner its cold bags (see the module docstring): the rooms, and the collectives.

    Args:
        pg: the sharding's process group.
        num_features: F, the features of the sharding.
        feature_units: per feature, the output dist's units of one bag's partial sum (None: 1
            each); the output all-to-all's split sizes come out of this exchange's sync.
    """

    def __init__(self, pg: dist.ProcessGroup, num_features: int, device: torch.device,
                 feature_units: Optional[List[int]] = None) -> None:
        self._pg, self._world = pg, pg.size()
        self._features, self._device = num_features, device
        self.feature_units = (None if feature_units is None or all(u == 1 for u in feature_units)
                              else torch.tensor(feature_units, dtype=torch.int64, device=device))
        # the next exchange's layout (rooms per destination and per source); None until an exchange taught them
        self.layout: Optional[ExchangeLayout] = None
        self.spills = 0  # exchanges past the first where some pair's run outgrew its room (a second all-to-all)

    @property
    def rooms(self) -> Optional[ExchangeLayout]:
        """The rooms the next exchange sends (None before the first exchange)."""
        return self.layout

    def layout_for(self, head: int) -> ExchangeLayout:
        """This step's layout: the taught rooms, or rooms of 0 (the first exchange, or another header size)."""
        if self.layout is not None and self.layout.head == head:
            return self.layout
        W = self._world
        return exchange_layout([0] * W, [0] * W, head, self._device)

    def start(self, pack: SplitPack, layout: ExchangeLayout) -> Tuple[torch.Tensor, Optional[dist.Work]]:
        """Starts the all-to-all of ``pack``'s send rows (packed for ``layout``): ``(receive buffer, work)``
        (on one rank the send rows are what arrives, no collective)."""
        if self._world == 1:
            return pack.send_rows, None
        rows_in = pack.send_rows.new_empty(sum(layout.recv_rows))
        work = dist.all_to_all_single(rows_in, pack.send_rows, layout.recv_rows, layout.send_rows, group=self._pg,
                                      async_op=True)
        return rows_in, work

    def received(self, pack: SplitPack, layout: ExchangeLayout, rows_in: torch.Tensor, weighted: bool,
                 report_words: int, finish: Callable) -> ColdTensorsAwaitable:
        """After the all-to-all: the step's one host sync (every size, the reports, the spill flag), the next
        step's rooms, and the spill all-to-all if some run outgrew its room; ``finish`` unpacks on waiting."""
        F = self._features
        summary = fused.exchange_summary(rows_in, layout, F, self.feature_units, pack.stats)
        sizes = ExchangeSizes.parse(summary.tolist(), self._world, F, weighted, report_words)
        send_next = [next_room(r or None, n) for r, n in zip(layout.rooms, sizes.send_words)]
        recv_next = [next_room(r or None, n) for r, n in zip(layout.recv_rooms, sizes.recv_words)]
        if send_next != layout.rooms or recv_next != layout.recv_rooms or self.layout is not layout:
            self.layout = exchange_layout(send_next, recv_next, layout.head, rows_in.device)
        rest_in, work = rows_in.new_empty(0), None
        if sizes.spilled:  # every rank: the words past each pair's room, in one more all-to-all
            self.spills += any(layout.rooms)  # the first exchange's rooms of 0 spill by design
            over_send = [max(0, n - r) for n, r in zip(sizes.send_words, layout.rooms)]
            over_recv = [max(0, n - r) for n, r in zip(sizes.recv_words, layout.recv_rooms)]
            rest = composed.spill_words(pack.payload, sizes.send_words, layout.rooms)
            if self._world == 1:
                rest_in = rest
            else:
                rest_in = rest.new_empty(sum(over_recv))
                work = dist.all_to_all_single(rest_in, rest, over_recv, over_send, group=self._pg, async_op=True)
        return ColdTensorsAwaitable(ColdExchange(rows_in, rest_in, layout, sizes, pack), work, finish)
