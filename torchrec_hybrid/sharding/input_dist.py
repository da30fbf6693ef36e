"""Input dist of the frequency-hybrid sharding: remap, split hot/cold, ship cold ids.

Per step and per rank (local batch B, F features of hybrid tables):
1. every id becomes a key ``table_offset + id`` (all tables at once) and is looked up in a
   dense key -> hot-slot map (one gather), or, when the tables are too large in total for
   such a map, by binary search in the sorted hot keys -> a hot slot or "cold";
2. hot ids stay local, as indices into the replicated hot TBE;
3. cold ids are bucketized by owner (row-wise blocks, the stock RW layout); only the
   non-empty bags go to their owner, in two all-to-alls (cold_all_to_all.py).
The forward does all local work and returns a :class:`HybridInputDistAwaitable`; the cold
all-to-all starts when the sharded module hands it this step's id-check report
(:meth:`HybridInputDistAwaitable.start`), so the verdicts ride the cold metadata.
The result handed to the lookup is a :class:`HybridLookupInput`: the received cold bags plus
the local hot part and the lengths the output dist needs to route partial sums back. When
the optimizer could change a row on a zero gradient, the hot rows this rank looked up are
also all-gathered (a bit mask), overlapping the all-to-alls: only rows some rank looked up
may then be updated (hot_replica.py).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid._compat import Deferred
from torchrec_hybrid.sharding import row_blocks
from torchrec_hybrid.sharding.cold_all_to_all import ColdBags, ColdIdsAllToAll
from torchrec_hybrid.sharding.hot_state import HotState
from torchrec_hybrid.sharding.segments import exclusive_cumsum


@dataclass
class HybridLookupInput:
    """What the hybrid lookup consumes for one step (one element of SEBC's ``KJTList``).

    cold: the bags received from every rank for the rows this rank owns (local row ids),
        only the non-empty ones, ``cold.counts[w, f]`` from rank w for feature f.
    hot_indices / hot_offsets / hot_weights: the local batch's hot lookups, jagged by
        (feature, sample); indices are hot slots (rows of the replicas, all groups numbered
        together).
    touched: None, or () -> bool ``[total hot rows]``: the hot slots any rank looked up
        this step (when only those may be updated).
    hot: the hot set the ids were split by (hot_state.py): the lookup and output dist use
        it, so a refresh never mixes two sets within a step.
    sent_cells: the bags this rank sent (each with >= 1 cold id), in (owner, feature,
        sample) order - the order their partial sums come back in - as cells
        ``sample * F + feature`` of the pooled output.
    sent_counts: how many of them per ``[owner, feature]``.
    lengths: the full bag lengths ``[F, B]`` of the local batch (MEAN pooling divisor).
    """

    cold: ColdBags
    hot_indices: torch.Tensor
    hot_offsets: torch.Tensor
    hot_weights: Optional[torch.Tensor]
    touched: Optional[Callable[[], torch.Tensor]]
    hot: HotState
    sent_cells: torch.Tensor
    sent_counts: torch.Tensor
    lengths: torch.Tensor

    @property
    def id_reports(self) -> Optional[torch.Tensor]:
        """None, or every rank's id-check report words (:func:`id_report_words`), int32
        ``[W, ID_REPORT_WORDS]``, carried to here by the cold ids' metadata all-to-all."""
        return self.cold.reports

    # Hooks TorchRec's KJTList / pipelines call on their elements.
    def variable_stride_per_key(self) -> bool:
        return False

    def record_stream(self, stream: torch.Stream) -> None:
        self.cold.record_stream(stream)
        for t in (self.hot_indices, self.hot_offsets, self.hot_weights,
                  self.sent_cells, self.sent_counts, self.lengths):
            if t is not None:
                t.record_stream(stream)


ID_REPORT_WORDS = 4  # int32 words of one rank's input-check report in the cold metadata


def id_report_words(report: torch.Tensor) -> torch.Tensor:
    """An int64 input-check report ``[code, index, value]`` (the rank's first problem - a bad
    id, a non-finite weight or a malformed batch, ``sharded_ebc.py``; zeros: none) as the
    int32 words the cold metadata carries: ``[code, index, value low word, value high word]``."""
    return torch.cat([report[:2].to(torch.int32), report[2:].view(torch.int32)])


def id_reports_from_words(words: torch.Tensor) -> torch.Tensor:
    """Every rank's report words ``[W, ID_REPORT_WORDS]`` back as int64 reports ``[W, 3]``."""
    return torch.cat([words[:, :2].to(torch.int64), words[:, 2:].clone().view(torch.int64)], 1)


class HybridInputDistAwaitable(Deferred):
    """The input dist's result for one step, its cold all-to-all not started yet.

    :meth:`start` starts it, carrying the given id-check report words to every rank (every
    rank must pass words, or every rank None); waiting first starts it with none.
    """

    def __init__(self, launch: Callable[[Optional[torch.Tensor]], Awaitable[Awaitable[HybridLookupInput]]]) -> None:
        super().__init__(self._metadata_sent)
        self._launch = launch
        self._started: Optional[Awaitable[Awaitable[HybridLookupInput]]] = None

    def start(self, id_report: Optional[torch.Tensor]) -> None:
        if self._started is not None:
            raise RuntimeError("this step's cold all-to-all has already started")
        self._started = self._launch(id_report)

    def _metadata_sent(self) -> Awaitable[HybridLookupInput]:
        if self._started is None:
            self.start(None)
        started = self._started
        assert started is not None  # start() set it
        return started.wait()


DENSE_MAP_MAX_ROWS = 1 << 24  # 128 MiB of int64 per sharding, at most


class HybridSparseFeaturesDist(nn.Module):
    """Splits each feature's ids into hot (kept) and cold (sent to the owner rank).

    Args:
        pg: process group of the sharding.
        feature_tables: index of each feature's table in ``table_rows`` (sharding order).
        table_rows: ``num_embeddings`` per hybrid table.
        state: the hot set (hot_state.py: sorted hot ids per table, same order as
            ``table_rows``, and the slot of each table's first hot id); replaced by
            :meth:`set_hot_state`, and stamped on every input this dist produces.
        row_bounds: per feature, its table's row bounds (row_blocks.py: rank r owns rows
            ``b[r] .. b[r+1]-1``), the cold shard's layout.
        device: where the ids live.
        exchange_touched: all-gather which hot slots each rank looks up (see the module doc).
    """

    # buffers (register_buffer in __init__)
    _hot_keys: torch.Tensor
    _key_slots: torch.Tensor
    _slot_map: Optional[torch.Tensor]
    _feature_key_offset: torch.Tensor
    _block_sizes: torch.Tensor

    def __init__(
        self,
        pg: dist.ProcessGroup,
        feature_tables: List[int],
        table_rows: List[int],
        state: HotState,
        row_bounds: List[List[int]],
        device: torch.device,
        exchange_touched: bool = False,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._world = pg.size()
        self._num_features = len(feature_tables)
        rows = torch.tensor(table_rows, dtype=torch.int64)
        table_offset = exclusive_cumsum(rows)
        ft = torch.tensor(feature_tables, dtype=torch.int64)
        self._table_offset = table_offset.tolist()
        self._total_rows = int(rows.sum())
        self._exchange_requested = exchange_touched
        self._device = device
        self.set_hot_state(state)
        self.register_buffer("_feature_key_offset", table_offset[ft].to(device), persistent=False)
        # Even blocks (the stock row-wise layout) bucketize by division; any other layout by
        # FBGEMM's per-feature block positions (a binary search per id).
        block_sizes = [(b[-1] + self._world - 1) // self._world for b in row_bounds]
        self.register_buffer(
            "_block_sizes", torch.tensor(block_sizes, dtype=torch.int64, device=device), persistent=False
        )
        even = all(list(b) == row_blocks.even_bounds(b[-1], self._world) for b in row_bounds)
        self._block_pos = None if even else [torch.tensor(b, dtype=torch.int64, device=device) for b in row_bounds]
        self._cold_a2a = ColdIdsAllToAll(pg, self._num_features, device)

    def set_hot_state(self, state: HotState) -> None:
        """Splits ids by ``state``'s hot set from the next forward on (refresh time: rebuilds
        the key -> slot map). Inputs already produced keep the state they were split by."""
        device = self._device
        keys = [h.to(torch.int64).cpu() + off for h, off in zip(state.hot_ids, self._table_offset)]
        hot_keys = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64)
        slots = [torch.arange(s, s + h.numel()) for h, s in zip(state.hot_ids, state.slot_starts)]
        key_slots = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
        self._state = state
        self._total_hot = int(hot_keys.numel())
        self._exchange_touched = self._exchange_requested and self._total_hot > 0
        self.register_buffer("_hot_keys", hot_keys.to(device), persistent=False)
        self.register_buffer("_key_slots", key_slots.to(device), persistent=False)
        # Tables small enough in total get a dense key -> slot map (one gather per id);
        # larger ones use a binary search over the sorted hot keys (memory O(hot rows)).
        slot_map = None
        if self._total_rows <= DENSE_MAP_MAX_ROWS:
            # int64: the slots index the hot TBE as they are, with no cast per step
            slot_map = torch.full((self._total_rows,), -1, dtype=torch.int64)
            slot_map[hot_keys] = key_slots
            slot_map = slot_map.to(device)
        self.register_buffer("_slot_map", slot_map, persistent=False)

    def forward(self, features: KeyedJaggedTensor) -> HybridInputDistAwaitable:
        with record_function("## hybrid:input_dist ##"):
            return self._forward(features)

    def _forward(self, features: KeyedJaggedTensor) -> HybridInputDistAwaitable:
        F, W = self._num_features, self._world
        B = features.stride()
        values = features.values()
        flat_lengths = features.lengths()
        lengths = flat_lengths.view(F, B)
        weights = features.weights_or_none()
        per_feature = torch.tensor(features.length_per_key(), device=values.device)
        key_offset = torch.repeat_interleave(self._feature_key_offset, per_feature, output_size=values.numel())
        keys = values.to(torch.int64) + key_offset
        if self._slot_map is not None:
            slot = self._slot_map.index_select(0, keys)
            is_hot = slot >= 0
        elif self._total_hot > 0:
            pos = torch.searchsorted(self._hot_keys, keys).clamp_(max=self._total_hot - 1)
            is_hot = self._hot_keys.index_select(0, pos) == keys
            slot = self._key_slots.index_select(0, pos)
        else:
            slot = torch.zeros_like(keys)
            is_hot = torch.zeros_like(keys, dtype=torch.bool)
        is_cold = ~is_hot
        hot_slots, hot_lengths = torch.ops.fbgemm.masked_select_jagged_1d(slot, flat_lengths, is_hot)
        cold_values, cold_lengths = torch.ops.fbgemm.masked_select_jagged_1d(values, flat_lengths, is_cold)
        touched = self._start_touched_exchange(hot_slots) if self._exchange_touched else None
        # the stock row-wise bucketization (what bucketize_kjt_before_all2all calls), called
        # directly: the cold ids never need to be a KJT of their own
        block_sizes = self._block_sizes if values.dtype == torch.int64 else self._block_sizes.to(values.dtype)
        sent, local_rows, sent_weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            cold_lengths.to(flat_lengths.dtype), cold_values, bucketize_pos=False, sequence=False,
            block_sizes=block_sizes, my_size=W, weights=None if weights is None else weights[is_cold],
            block_bucketize_pos=self._block_pos if self._block_pos is None or values.dtype == torch.int64
            else [p.to(values.dtype) for p in self._block_pos],
        )
        # Only the non-empty (owner, feature, sample) bags travel, in that order: lengths on
        # the wire scale with the cold lookups, not with W * F * B.
        sent = sent.view(-1)
        bag = sent.nonzero().view(-1)  # lengths are >= 0
        group = torch.div(bag, B, rounding_mode="floor")  # owner * F + feature
        per_group = torch.bincount(group, minlength=W * F)
        ids_per_group, sent_lengths = sent.view(W * F, B).sum(1), sent.index_select(0, bag)
        local = dict(
            hot_indices=hot_slots,
            hot_offsets=torch.ops.fbgemm.asynchronous_complete_cumsum(hot_lengths),
            hot_weights=None if weights is None else weights[is_hot],
            touched=touched,
            hot=self._state,
            sent_cells=(bag - group * B) * F + group % F,
            sent_counts=per_group.view(W, F),
            lengths=lengths,
        )

        def launch(id_report: Optional[torch.Tensor]) -> Awaitable[Awaitable[HybridLookupInput]]:
            cold = self._cold_a2a(per_group, ids_per_group, sent_lengths, local_rows, sent_weights,
                                  None if id_report is None else id_report.to(values.device))

            def metadata_arrived() -> Awaitable[HybridLookupInput]:
                payload = cold.wait()  # the payload all-to-all is under way
                return Deferred(lambda: HybridLookupInput(cold=payload.wait(), **local))

            return Deferred(metadata_arrived)

        return HybridInputDistAwaitable(launch)

    def _start_touched_exchange(self, hot_slots: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts an async all-gather of this rank's looked-up hot slots (one byte each)."""
        mine = torch.zeros(self._total_hot, dtype=torch.uint8, device=hot_slots.device)
        mine[hot_slots] = 1
        if self._world == 1:
            return lambda: mine.bool()
        every = torch.empty(self._world * self._total_hot, dtype=torch.uint8, device=hot_slots.device)
        work = dist.all_gather_into_tensor(every, mine, group=self._pg, async_op=True)

        def union() -> torch.Tensor:
            work.wait()
            return every.view(self._world, -1).amax(0).bool()

        return union
