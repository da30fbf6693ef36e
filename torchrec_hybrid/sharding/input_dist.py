"""Input dist of the frequency-hybrid sharding: remap, split hot/cold, ship cold ids.

Per step and per rank (local batch B, F features of hybrid tables):
1. every id becomes a key ``table_offset + id`` (all tables at once) and is looked up in a
   dense key -> hot-slot map (one gather), or, when the tables are too large in total for
   such a map, by binary search in the sorted hot keys -> a hot slot or "cold";
2. every id is bucketized by FBGEMM's ``bucketize_sparse_features``: a cold id to its
   owner with its row there (any row layout, row_blocks.py), a hot id to an extra bucket W
   that stays here, as its replica row. The key map of step 1 holds each id's bucket and
   row already, encoded as ``row * (W + 1) + bucket`` (:func:`row_blocks.bucket_ids`),
   which the cyclic bucketization into W + 1 buckets decodes (bucket ``id % (W + 1)``,
   row ``id // (W + 1)``); only the non-empty cold bags go to their
   owner, in one all-to-all per step (two on the first step and when a run outgrows its room;
   cold_all_to_all.py);
3. bucket W is the replicated hot TBE's input as it stands: it comes last, in (feature,
   sample) order, and the hot TBE reads it through offsets into the bucketized ids (one
   cumsum of the bucketized lengths), nothing else.
Every shape is known before any data is read, so nothing here waits for the device (on a
GPU, a data-dependent size such as a hot/cold split's would be a host sync per step).
The forward does all local work and returns a :class:`HybridInputDistAwaitable`; the cold
all-to-all starts when the sharded module hands it this step's id-check report
(:meth:`HybridInputDistAwaitable.start`), so the verdicts ride the cold ids' header.
The result handed to the lookup is a :class:`HybridLookupInput`: the received cold bags plus
the local hot part and the lengths the output dist needs to route partial sums back. When
the optimizer could change a row on a zero gradient, the hot rows this rank looked up are
also all-gathered (a bit mask), overlapping the all-to-alls: only rows some rank looked up
may then be updated (hot_replica.py).
"""

import sys
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid._compat import Deferred
from torchrec_hybrid.sharding import row_blocks
from torchrec_hybrid.sharding.cells import partial_units
from torchrec_hybrid.sharding.cold_all_to_all import ColdBags, ColdIdsAllToAll
from torchrec_hybrid.sharding.hot_state import HotState
from torchrec_hybrid.sharding.segments import cached_tensor, exclusive_cumsum


@dataclass
class HybridLookupInput:
    """What the hybrid lookup consumes for one step (one element of SEBC's ``KJTList``).

    cold: the bags received from every rank for the rows this rank owns (local row ids),
        only the non-empty ones, ``cold.bag_counts[w, f]`` from rank w for feature f.
    hot_indices / hot_offsets / hot_weights: the local batch's hot lookups for the
        replicas, as rows of their feature's replica table, jagged by (feature, sample):
        ``hot_offsets`` (``[F * B + 1]``) index into ``hot_indices``, whose hot rows come
        last; no offset spans the head (the cold ids' places).
    touched: None, or () -> bool ``[total hot rows]``: the hot slots any rank looked up
        this step (when only those may be updated).
    hot: the hot set the ids were split by (hot_state.py): the lookup and output dist use
        it, so a refresh never mixes two sets within a step.
    sent_cells: the bags this rank sent (each with >= 1 cold id), in (owner, feature,
        sample) order - the order their partial sums come back in - as cells
        ``sample * F + feature`` of the pooled output; followed by padding (the count is
        ``cold.host_sent_bags``).
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
    def id_reports(self) -> Optional[List[int]]:
        """None, or every rank's id-check report words (:func:`id_report_words`), one host list
        of ``ID_REPORT_WORDS`` per rank in rank order, carried to here by the cold ids' header
        all-to-all."""
        return self.cold.host_reports

    # Hooks TorchRec's KJTList / pipelines call on their elements.
    def variable_stride_per_key(self) -> bool:
        return False

    def record_stream(self, stream: torch.Stream) -> None:
        self.cold.record_stream(stream)
        for t in (self.hot_indices, self.hot_offsets, self.hot_weights,
                  self.sent_cells, self.sent_counts, self.lengths):
            if t is not None:
                t.record_stream(stream)


ID_REPORT_WORDS = 4  # int32 words of one rank's input-check report in the cold ids' header


def id_report_words(report: torch.Tensor) -> torch.Tensor:
    """An int64 input-check report ``[code, index, value]`` (the rank's first problem - a bad
    id, a non-finite weight or a malformed batch, ``sharded_ebc.py``; zeros: none) as the
    int32 words the cold ids' header carries: ``[code, index, value low word, value high word]`` (one gather
    of its int32 words, low word first; code and index fit one)."""
    # the words of [code, index, value] as int64s: low then high words on a little-endian host, else high then low
    order = (0, 2, 4, 5) if sys.byteorder == "little" else (1, 3, 5, 4)
    return report.view(torch.int32).index_select(0, cached_tensor(order, torch.int64, report.device))


def id_reports_from_words(words: List[int]) -> List[List[int]]:
    """Every rank's report words (a host list, ``ID_REPORT_WORDS`` per rank) as reports
    ``[code, index, value]``; when no rank reports a problem (every step but a rejected one),
    no per-rank Python work: one slice of the codes."""
    n = ID_REPORT_WORDS
    if not any(words[0::n]):
        return [[0, 0, 0]] * (len(words) // n)
    return [[words[i], words[i + 1], (words[i + 2] & 0xFFFFFFFF) | (words[i + 3] << 32)]
            for i in range(0, len(words), n)]


class _SentBags(NamedTuple):
    """The non-empty cold bags this rank sends, front-packed into fixed-size buffers."""

    bag_counts: torch.Tensor  # how many per (owner, feature)  [W * F]
    id_counts: torch.Tensor  # how many cold ids per (owner, feature)  [W * F]
    lengths: torch.Tensor  # their lengths, then padding  [W * F * B]
    cells: torch.Tensor  # their cells sample * F + feature, then padding  [W * F * B]


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
        feature_dims: each feature's width, for the output all-to-all's split sizes, which
            the cold exchange's host sync computes (cells.partial_units); None: 1 per feature.
    """

    # buffers (register_buffer in __init__)
    _hot_keys: torch.Tensor
    _key_slots: torch.Tensor
    _slot_map: Optional[torch.Tensor]
    _route_map: Optional[torch.Tensor]
    _feature_key_offset: torch.Tensor
    _feature_ids: torch.Tensor
    _block_bounds: torch.Tensor

    def __init__(
        self,
        pg: dist.ProcessGroup,
        feature_tables: List[int],
        table_rows: List[int],
        state: HotState,
        row_bounds: List[List[int]],
        device: torch.device,
        exchange_touched: bool = False,
        feature_dims: Optional[List[int]] = None,
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
        self.register_buffer("_feature_key_offset", table_offset[ft].to(device), persistent=False)
        self.register_buffer("_feature_ids", torch.arange(self._num_features, device=device), persistent=False)
        # every table's row blocks as keys (rank after rank, table after table, then the end
        # of the last): bounds whose block index gives a cold key's owner and row there
        W = self._world
        self._table_feature = [feature_tables.index(t) for t in range(len(table_rows))]  # a feature per table
        starts = [off + b for t, off in enumerate(self._table_offset) for b in row_bounds[self._table_feature[t]][:-1]]
        self.register_buffer("_block_bounds", torch.tensor(starts + [self._total_rows], dtype=torch.int64,
                                                           device=device), persistent=False)
        # the bucketized ids' dtype: int32 when every encoded id fits (half the work of int64)
        top = row_blocks.bucket_ids(torch.tensor(self._total_rows), W, W)  # rows, replica rows < total rows
        self._id_dtype = torch.int32 if int(top) < 2 ** 31 else torch.int64
        units = None if feature_dims is None else partial_units(feature_dims)
        self._cold_a2a = ColdIdsAllToAll(pg, self._num_features, device, feature_units=units)
        self._cells_cache: Tuple[int, torch.Tensor] = (-1, torch.empty(0, dtype=torch.int64))
        self.set_hot_state(state)

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
        # Tables small enough in total get a dense key map (one gather per id): the id the
        # bucketization decodes (row_blocks.bucket_ids: cold ids to their owner, hot ones to
        # bucket W). Larger tables use binary searches over the sorted hot keys and the
        # blocks' starts (memory O(hot rows + W * tables)).
        route_map = slot_map = None
        if self._total_rows <= DENSE_MAP_MAX_ROWS:
            rows = torch.tensor(self._table_offset[1:] + [self._total_rows]) - torch.tensor(self._table_offset)
            key_table = torch.repeat_interleave(torch.arange(len(self._table_feature)), rows)
            hot_table = key_table[hot_keys]
            shift = state.feature_shift.cpu()[self._table_feature]
            route_map = self._cold_ids(torch.arange(self._total_rows), self._block_bounds.cpu())
            route_map[hot_keys] = row_blocks.bucket_ids(key_slots - shift[hot_table], self._world, self._world)
            route_map = route_map.to(device=device, dtype=self._id_dtype)
            if self._exchange_touched:
                slot_map = torch.full((self._total_rows,), -1, dtype=torch.int64)
                slot_map[hot_keys] = key_slots
                slot_map = slot_map.to(device)
        self.register_buffer("_route_map", route_map, persistent=False)
        self.register_buffer("_slot_map", slot_map, persistent=False)

    @property
    def cold_exchange(self) -> ColdIdsAllToAll:
        """The cold ids' all-to-all this dist starts every step."""
        return self._cold_a2a

    def forward(self, features: KeyedJaggedTensor) -> HybridInputDistAwaitable:
        with record_function("## hybrid:input_dist ##"):
            return self._forward(features)

    def _forward(self, features: KeyedJaggedTensor) -> HybridInputDistAwaitable:
        F, W = self._num_features, self._world
        B = features.stride()
        values = features.values()
        flat_lengths = features.lengths()
        weights = features.weights_or_none()
        # ids per feature from the lengths, on the device (no host list to copy over: a sync)
        routed, touched = self._route(values, flat_lengths.view(F, B).sum(1))
        sent, local_rows, sent_weights = self._bucketize(flat_lengths, routed, weights)
        bags = self._nonempty_bags(sent[:W * F * B], B)
        # bucket W holds the hot lookups (replica rows), last: offsets into the bucketized ids
        hot_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(sent)[W * F * B:]
        hot_indices, hot_weights = local_rows, sent_weights
        state = self._state
        local = dict(
            hot_indices=hot_indices,
            hot_offsets=hot_offsets,
            hot_weights=hot_weights,
            touched=touched,
            hot=state,
            sent_cells=bags.cells,
            sent_counts=bags.bag_counts.view(W, F),
            lengths=flat_lengths.view(F, B),
        )

        def launch(id_report: Optional[torch.Tensor]) -> Awaitable[Awaitable[HybridLookupInput]]:
            cold = self._cold_a2a(bags.bag_counts, bags.id_counts, bags.lengths, local_rows, sent_weights,
                                  None if id_report is None else id_report.to(values.device))

            def metadata_arrived() -> Awaitable[HybridLookupInput]:
                payload = cold.wait()  # the payload all-to-all is under way
                return Deferred(lambda: HybridLookupInput(cold=payload.wait(), **local))

            return Deferred(metadata_arrived)

        return HybridInputDistAwaitable(launch)

    def _cold_ids(self, keys: torch.Tensor, block_bounds: torch.Tensor) -> torch.Tensor:
        """The bucketized ids of these keys as cold ids: owner and row there (the blocks of
        every table as one layout of W blocks per table, :func:`row_blocks.owners`)."""
        block = row_blocks.owners(keys, block_bounds)
        return row_blocks.bucket_ids(keys - block_bounds.index_select(0, block), block % self._world, self._world)

    def _route(self, values: torch.Tensor, per_feature: torch.Tensor):
        """Per id: the id the bucketization decodes (row_blocks.bucket_ids: cold ids to their
        owner, hot ids to bucket W as their replica row) and, when only looked-up hot rows
        may be updated, the started exchange of those."""
        n = values.numel()
        keys = torch.repeat_interleave(self._feature_key_offset, per_feature, output_size=n).add_(values)
        if self._route_map is not None:
            routed = self._route_map.index_select(0, keys)
            if not self._exchange_touched:
                return routed, None
            assert self._slot_map is not None  # built with the map when rows are exchanged
            slot = self._slot_map.index_select(0, keys)
            return routed, self._start_touched_exchange(slot, slot >= 0)
        fid = torch.repeat_interleave(self._feature_ids, per_feature, output_size=n)
        if self._total_hot > 0:
            pos = torch.searchsorted(self._hot_keys, keys).clamp_(max=self._total_hot - 1)
            slot, is_hot = self._key_slots.index_select(0, pos), self._hot_keys.index_select(0, pos) == keys
        else:
            slot, is_hot = torch.zeros_like(keys), torch.zeros_like(keys, dtype=torch.bool)
        state = self._state
        cold = self._cold_ids(keys, self._block_bounds)
        hot = row_blocks.bucket_ids(slot - state.feature_shift.index_select(0, fid), self._world, self._world)
        routed = torch.where(is_hot, hot, cold).to(self._id_dtype)
        return routed, self._start_touched_exchange(slot, is_hot) if self._exchange_touched else None

    def _bucketize(self, lengths: torch.Tensor, routed: torch.Tensor, weights: Optional[torch.Tensor]):
        """Every id bucketized by owner, hot ids into an extra bucket W that is never sent:
        ``(lengths [(W + 1) * F * B], local rows, weights)`` in (bucket, feature, sample)
        order, so the cold ids are a prefix (:func:`row_blocks.bucketize`)."""
        return row_blocks.bucketize(lengths, routed, self._world, weights)

    def _nonempty_bags(self, sent: torch.Tensor, B: int) -> "_SentBags":
        """The non-empty (owner, feature, sample) bags of ``sent`` (lengths ``[W * F * B]``)
        moved to the front in that order (a stable partition: no data-dependent shape)."""
        W, F = self._world, self._num_features
        n = sent.numel()
        nonempty = sent > 0
        per_group = nonempty.view(W * F, B).sum(1)
        # a non-empty bag goes to its rank among them; every empty one to a spare last place
        # (written over and over, cut off: only the first bags are ever read)
        target = torch.where(nonempty, torch.cumsum(nonempty, 0) - 1, n)
        cells = self._bag_cells(B, sent.device)
        # 1-D scatters (scatter_: about twice as fast as index_copy_ on CPU, same result)
        lengths = sent.new_empty(n + 1).scatter_(0, target, sent)[:n]
        return _SentBags(per_group, sent.view(W * F, B).sum(1), lengths,
                         cells.new_empty(n + 1).scatter_(0, target, cells)[:n])

    def _bag_cells(self, B: int, device: torch.device) -> torch.Tensor:
        """Each (owner, feature, sample) bag's cell ``sample * F + feature``, cached per batch
        size (a training run has one or two)."""
        if self._cells_cache[0] != B:
            F = self._num_features
            index = torch.arange(self._world * F * B, device=device)
            group = torch.div(index, B, rounding_mode="floor")  # owner * F + feature
            self._cells_cache = (B, (index - group * B) * F + group % F)
        return self._cells_cache[1]

    def _start_touched_exchange(self, slot: torch.Tensor, is_hot: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts an async all-gather of which hot slots this rank looks up (one byte each)."""
        n = self._total_hot
        mine = torch.zeros(n + 1, dtype=torch.uint8, device=slot.device)
        mine[torch.where(is_hot, slot, n)] = 1  # cold ids mark the spare last byte
        mine = mine[:n]
        if self._world == 1:
            return lambda: mine.bool()
        every = torch.empty(self._world * n, dtype=torch.uint8, device=slot.device)
        work = dist.all_gather_into_tensor(every, mine, group=self._pg, async_op=True)

        def union() -> torch.Tensor:
            work.wait()
            return every.view(self._world, -1).amax(0).bool()

        return union
