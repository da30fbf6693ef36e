"""Input dist of the frequency-hybrid sharding: split each id hot or cold, ship the cold ones.

Per step and per rank (local batch B, F features of hybrid tables), one fused op
(:func:`fused.split_pack`; composed.py spells it out in torch and FBGEMM ops):
1. every id becomes a key ``table_offset + id`` (all tables at once) and is looked up in a
   dense key map (or, when the tables are too large in total for one, by binary searches
   over the sorted hot keys and the row blocks): its bucket - the owner of its row, or W,
   "hot", for the local replica - and its row there (row_blocks.bucket_ids);
2. the cold bags go to their owners in one all-to-all (cold_all_to_all.py), packed with the
   step's id-check report into each destination's header and room;
3. the hot lookups stay here as the replica TBE's input (rows and offsets, nothing else).
Every shape is known before any data is read; the step's one host sync is the cold
exchange's (all sizes at once). The forward returns a :class:`HybridInputDistAwaitable`
whose exchange starts when the sharded module hands it this step's id-check report
(:meth:`HybridInputDistAwaitable.start`), so the verdicts ride the cold ids' headers; waiting
syncs the sizes, then the :class:`~cold_all_to_all.ColdTensorsAwaitable` unpacks what the
owner received into its lanes' TBE inputs (:func:`fused.unpack_cold`): a
:class:`HybridLookupInput`. When the optimizer could change a row on a zero gradient, the hot
rows this rank looked up are also all-gathered (a bit mask), overlapping the all-to-all: only
rows some rank looked up may then be updated (hot_replica.py).
"""

import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_hybrid._compat import HybridAwaitable
from torchrec_hybrid import row_blocks
from torchrec_hybrid.sharding import fused
from torchrec_hybrid.sharding.cells import LaneLayout, partial_units
from torchrec_hybrid.sharding.cold_all_to_all import ColdExchange, ColdIdsAllToAll, ColdTensorsAwaitable, ExchangeSizes
from torchrec_hybrid.sharding.composed import ColdUnpacked, SplitPack
from torchrec_hybrid.sharding.hot_replica import HotSelection
from torchrec_hybrid.sharding.hot_state import HotState
from torchrec_hybrid.sharding.segments import cached_tensor, exclusive_cumsum


@dataclass
class HybridLookupInput:
    """What the hybrid lookup consumes for one step (one element of SEBC's ``KJTList``), and
    what the step's output dist needs from its input dist.

    lane_kjts: the owner's cold lookups, one fixed-batch KJT per lane (cells.LaneLayout): the
        bags received from every rank, then the owned hot rows as one-id bags.
    send: where each unit of the lanes' output goes in the output all-to-all (owner side).
    cold_units: units of the lanes' concatenated output.
    sizes: the cold exchange's sizes, on the host since its sync.
    pack: this rank's sample side: the bags it sent (as cells) and its hot lookups.
    hot: the hot set the ids were split by (hot_state.py), so a refresh never mixes two sets
        within a step; selection: the hot slots that travel this step.
    lengths: the full bag lengths ``[F, B]`` of the local batch (MEAN pooling divisor).
    """

    lane_kjts: List[KeyedJaggedTensor]
    send: ColdUnpacked
    cold_units: int
    sizes: ExchangeSizes
    pack: SplitPack
    hot: HotState
    selection: HotSelection
    lengths: torch.Tensor

    @property
    def id_reports(self) -> Optional[List[int]]:
        """None, or every rank's id-check report words (:func:`id_report_words`), one host list
        of ``ID_REPORT_WORDS`` per rank in rank order, carried here by the cold ids' headers."""
        return self.sizes.reports

    def __getattr__(self, name: str) -> None:
        """Code that reads this input as a KeyedJaggedTensor (a ``FeatureProcessedEmbeddingBagCollection``
        applying its feature processors to the sharded EBC's dist output) fails here, on every rank and
        before any lookup, with what to do; an AttributeError, so ``hasattr`` still answers False."""
        if name.startswith("__") or not hasattr(KeyedJaggedTensor, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        features = sorted({k for kjt in self.lane_kjts for k in kjt.keys()})
        raise AttributeError(
            f"frequency_hybrid features {features}: their lookup input is no KeyedJaggedTensor (no "
            f"{name}()), so code that reads it as one cannot run on it - a FeatureProcessedEmbeddingBagCollection's "
            "feature processors (position weights), most likely: frequency_hybrid does not support feature "
            "processors. Give that module's tables a stock sharding type (the planner does, through "
            "TorchRec's FeatureProcessedEmbeddingBagCollectionSharder).")

    # Hooks TorchRec's KJTList / pipelines call on their elements.
    def variable_stride_per_key(self) -> bool:
        return False

    def record_stream(self, stream: torch.Stream) -> None:
        for kjt in self.lane_kjts:
            kjt.record_stream(stream)
        for t in (*self.send, *self.pack, *self.selection[:5], self.lengths):
            if isinstance(t, torch.Tensor):
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


class HybridInputDistAwaitable(HybridAwaitable[ColdTensorsAwaitable]):
    """The input dist's result for one step, its cold exchange not started yet (the splits stage).

    :meth:`start` packs the batch and starts the exchange, its headers carrying the given id-check
    report words to every rank (every rank must pass words, or every rank None); waiting starts it
    with none if need be, then syncs the sizes: a :class:`~cold_all_to_all.ColdTensorsAwaitable`.
    """

    def __init__(self, dist_: "HybridSparseFeaturesDist", features: KeyedJaggedTensor, state: HotState,
                 route_map: Optional[torch.Tensor], touched: Optional[Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self._dist, self._features, self._touched = dist_, features, touched
        self._state, self._route_map = state, route_map  # the hot set of the forward, whenever it starts
        self._started: Optional[tuple] = None

    def start(self, id_report: Optional[torch.Tensor]) -> None:
        if self._started is not None:
            raise RuntimeError("this step's cold all-to-all has already started")
        self._started = self._dist.start(self._features, id_report, self._state, self._route_map)

    def result(self) -> ColdTensorsAwaitable:
        if self._started is None:
            self.start(None)
        assert self._started is not None
        pack, layout, rows_in, work, weighted, report_words = self._started
        if work is not None:
            work.wait()
        dist_, features, touched, state = self._dist, self._features, self._touched, self._state
        return dist_.cold_exchange.received(
            pack, layout, rows_in, weighted, report_words,
            lambda exchange: dist_.lookup_input(exchange, features, state, touched))


DENSE_MAP_MAX_ROWS = 1 << 24  # 128 MiB of int64 per sharding, at most


class HybridSparseFeaturesDist(BaseSparseFeaturesDist[HybridLookupInput]):
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
        lanes / lane_keys: the owner's cold lookup as lanes (cells.LaneLayout) and each lane's
            feature names (the lookup's TBE keys): what the received bags are unpacked into.
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
        lanes: LaneLayout,
        lane_keys: List[List[str]],
        exchange_touched: bool = False,
        feature_dims: Optional[List[int]] = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._world = pg.size()
        self._num_features = len(feature_tables)
        self._lanes, self._lane_keys = lanes, lane_keys
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
        self._table_feature = [feature_tables.index(t) for t in range(len(table_rows))]  # a feature per table
        starts = [off + b for t, off in enumerate(self._table_offset) for b in row_bounds[self._table_feature[t]][:-1]]
        self.register_buffer("_block_bounds", torch.tensor(starts + [self._total_rows], dtype=torch.int64,
                                                           device=device), persistent=False)
        # the bucketized ids' dtype: int32 when every encoded id fits (half the work of int64)
        top = row_blocks.bucket_ids(torch.tensor(self._total_rows), self._world, self._world)
        self._id_dtype = torch.int32 if int(top) < 2 ** 31 else torch.int64
        units = None if feature_dims is None else partial_units(feature_dims)
        self._cold_a2a = ColdIdsAllToAll(pg, self._num_features, device, feature_units=units)
        self._no_report = torch.empty(0, dtype=torch.int32, device=device)
        self.set_hot_state(state)

    def set_hot_state(self, state: HotState) -> None:
        """Splits ids by ``state``'s hot set from the next forward on (refresh time: rebuilds
        the key map). Inputs already produced keep the state they were split by."""
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
        """The cold ids' all-to-all this dist starts every step (its rooms and spills)."""
        return self._cold_a2a

    def forward(self, sparse_features: KeyedJaggedTensor) -> HybridInputDistAwaitable:
        touched = None
        if self._exchange_touched:
            with record_function("## hybrid:touched_rows ##"):
                touched = self._start_touched_exchange(*self._slots(sparse_features))
        return HybridInputDistAwaitable(self, sparse_features, self._state, self._route_map, touched)

    @record_function("## hybrid:input_dist ##")
    def start(self, features: KeyedJaggedTensor, id_report: Optional[torch.Tensor], state: HotState,
              route_map: Optional[torch.Tensor]) -> tuple:
        """Packs ``features`` (:func:`fused.split_pack`) by ``state``'s hot set (its ``route_map``) with the
        report words in every header and starts the cold exchange: ``(pack, layout, rows_in, work, weighted,
        report words)``."""
        values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
        if weights is not None and weights.dtype != torch.float32:
            weights = weights.to(torch.float32)
        report = self._no_report if id_report is None else id_report.to(device=values.device, dtype=torch.int32)
        layout = self._cold_a2a.layout_for(2 * self._num_features + report.numel() + 1)
        if route_map is None:  # tables too large for a dense map: the ids bucketized by searches
            values = self._searched_ids(values, lengths, state)
        pack = fused.split_pack(values, lengths, weights, route_map, self._feature_key_offset, self._world, report,
                                layout, self._cold_a2a.feature_units)
        rows_in, work = self._cold_a2a.start(pack, layout)
        return pack, layout, rows_in, work, weights is not None, report.numel()

    def lookup_input(self, exchange: ColdExchange, features: KeyedJaggedTensor, state: HotState,
                     touched: Optional[Callable[[], torch.Tensor]]) -> HybridLookupInput:
        """What the owner received, unpacked into its lanes' TBE inputs (:func:`fused.unpack_cold`), with this
        rank's own sample side of the step (split by ``state``'s hot set)."""
        selection = state.layout.select(None if touched is None else touched())
        sizes, lanes = exchange.sizes, self._lanes
        weighted = exchange.pack.hot_weights is not None
        bags = [n + e for n, e in zip(sizes.feature_bags, selection.extra_per_feature)]
        batches = lanes.batches(bags)
        send = fused.unpack_cold(exchange.rows_in, exchange.rest_in, exchange.layout, sizes.recv_words,
                                 self._num_features, weighted, lanes, batches, selection.extra_features,
                                 selection.extra_rows, selection.extra_per_feature, sizes.return_units,
                                 sizes.feature_bags, sizes.feature_ids)
        ids = [n + e for n, e in zip(sizes.feature_ids, selection.extra_per_feature)]
        kjts, len0, id0 = [], 0, 0
        for fs, names, batch, slots in zip(lanes.lane_features, self._lane_keys, batches, lanes.lane_slots):
            lpk = [ids[f] for f in fs]  # per lane (group): views of the unpacked ids and lengths
            n = sum(lpk)
            kjts.append(KeyedJaggedTensor(
                keys=names, values=send.ids[id0:id0 + n], lengths=send.lengths[len0:len0 + slots * batch],
                weights=None if send.weights is None else send.weights[id0:id0 + n], stride=batch,
                length_per_key=lpk if slots == len(fs) else None))
            len0, id0 = len0 + slots * batch, id0 + n
        F = self._num_features
        return HybridLookupInput(
            lane_kjts=kjts, send=send, cold_units=sum(b * u for b, u in zip(batches, lanes.lane_units)),
            sizes=sizes, pack=exchange.pack, hot=state, selection=selection,
            lengths=features.lengths().view(F, -1))

    def _cold_ids(self, keys: torch.Tensor, block_bounds: torch.Tensor) -> torch.Tensor:
        """The bucketized ids of these keys as cold ids: owner and row there (the blocks of
        every table as one layout of W blocks per table, :func:`row_blocks.owners`)."""
        block = row_blocks.owners(keys, block_bounds)
        return row_blocks.bucket_ids(keys - block_bounds.index_select(0, block), block % self._world, self._world)

    def _keys(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        per_feature = lengths.view(self._num_features, -1).sum(1)
        return torch.repeat_interleave(self._feature_key_offset, per_feature, output_size=values.numel()).add_(values)

    def _searched_ids(self, values: torch.Tensor, lengths: torch.Tensor, state: HotState) -> torch.Tensor:
        """Per id the bucketized id (row_blocks.bucket_ids) by binary searches: the large tables' route."""
        keys = self._keys(values, lengths)
        per_feature = lengths.view(self._num_features, -1).sum(1)
        fid = torch.repeat_interleave(self._feature_ids, per_feature, output_size=values.numel())
        slot, is_hot = self._hot_slots(keys)
        cold = self._cold_ids(keys, self._block_bounds)
        hot = row_blocks.bucket_ids(slot - state.feature_shift.index_select(0, fid), self._world, self._world)
        return torch.where(is_hot, hot, cold).to(self._id_dtype)

    def _hot_slots(self, keys: torch.Tensor):
        """Per key its hot slot and whether it is hot (binary search in the sorted hot keys)."""
        if self._total_hot == 0:
            return torch.zeros_like(keys), torch.zeros_like(keys, dtype=torch.bool)
        pos = torch.searchsorted(self._hot_keys, keys).clamp_(max=self._total_hot - 1)
        return self._key_slots.index_select(0, pos), self._hot_keys.index_select(0, pos) == keys

    def _slots(self, features: KeyedJaggedTensor):
        """Per id its hot slot and whether it is hot (the touched-rows exchange's input)."""
        keys = self._keys(features.values(), features.lengths())
        if self._slot_map is not None:
            slot = self._slot_map.index_select(0, keys)
            return slot, slot >= 0
        return self._hot_slots(keys)

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
