"""The frequency-hybrid embedding sharding: composition of input dist, lookup, output dist.

The row layout is a stock row-wise one (``RwPooledEmbeddingSharding`` computes it from the
plan; row_blocks.py); a column-wise cold table is cut in column slices, each its own
row-blocked table here, whose outputs are put back side by side. The hot rows are also
replicated on every rank (hot_replica.py). docs/architecture.md §2-3 describe the data path."""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.types import (
    EnumerableShardingSpec,
    QuantizedCommCodecs,
    ShardedTensorMetadata,
    ShardingEnv,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import PoolingType

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.hot_replica import zero_grad_is_noop
from torchrec_hybrid.sharding.hot_state import HotState, build_hot_state
from torchrec_hybrid.sharding.cold_all_to_all import ColdIdsAllToAll
from torchrec_hybrid.sharding.input_dist import HybridSparseFeaturesDist
from torchrec_hybrid.sharding.lookup import HybridLookup, lanes_of, own_lane_pays
from torchrec_hybrid.sharding.output_dist import OUTPUT_COMM_OP, HybridPooledEmbeddingDist, describe_codec_problems
from torchrec_hybrid.row_blocks import heavy_tables, is_row_layout, slices_of


class HybridPooledEmbeddingSharding(_compat.RwPooledShardingWithTables):
    """Frequency-hybrid sharding of pooled tables (one instance per EBC, all hybrid tables).

    Args:
        sharding_infos / env / device: as for stock shardings.
        hot_ids: validated, sorted int64 hot row ids per table name.
        qcomm_codecs_registry: as for stock shardings; its ``POOLED_EMBEDDINGS_ALL_TO_ALL``
            codecs (FP16 / BF16, forward and backward apart) encode the output all-to-all
            like TorchRec's pooled all-to-all; codecs it cannot honour raise ``ValueError``.
    """

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
        hot_ids: Mapping[str, torch.Tensor],
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        problem = describe_codec_problems(qcomm_codecs_registry)
        if problem is not None:  # the sharded EBC refuses these first (check_hybrid_supported); other callers here
            raise ValueError(f"tables {sorted(i.embedding_config.name for i in sharding_infos)}: frequency_hybrid "
                             f"cannot honour {problem}")
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        self._setup = _compat.rw_sharding_setup(self)
        groups = _compat.sharding_grouped_configs(self)
        self._tables = [t for g in groups for t in g.embedding_tables]  # a column-wise table: one per slice
        self._hot_ids_per_group = [[hot_ids[t.name] for t in g.embedding_tables] for g in groups]
        # ids per sample the plan expects per table (HybridParameterSharding.pooling_factor; None: unknown)
        self._pooling = {i.embedding_config.name: getattr(i.param_sharding, "pooling_factor", None)
                         for i in sharding_infos}
        rank, world = self._setup.rank, self._setup.world_size
        slice_bounds = {}
        for i in sharding_infos:
            c = i.embedding_config
            for sl in slices_of(c.name, i.param_sharding, c.num_embeddings, c.embedding_dim, world):
                slice_bounds[(c.name, sl.offset)] = sl.bounds
        self._bounds = [slice_bounds[(t.name, t.local_metadata.shard_offsets[1])] for t in self._tables]
        for t, b in zip(self._tables, self._bounds):  # the owner blocks the input dist bucketizes by
            if t.local_metadata.shard_offsets[0] != b[rank]:
                raise RuntimeError(f"table '{t.name}': local shard at row {t.local_metadata.shard_offsets[0]}, "
                                   f"plan says {b[rank]}")
        # Owners send every hot row each step unless a zero-gradient update could change a
        # row (weight decay, Adam, ...): then only rows some rank looked up, and the input
        # dist gathers which those are.
        self._exchange_touched = not all(zero_grad_is_noop(g.fused_params) for g in groups)
        self._state: Optional[HotState] = None
        self._input_dists: List[HybridSparseFeaturesDist] = []
        self._lanes: Optional[tuple] = None  # (lane configs, layout, keys): the owner's cold lookup (lookup.lanes_of)

    def shard_tables(self, sharding_infos: List[EmbeddingShardingInfo], stock_shard) -> list:
        """Per rank its tables: stock row-wise for row blocks; for column-wise cold (and a lone
        shard of the whole table) one table per slice, every row on its owner, none elsewhere (other ranks keep a
        table of 0 rows so the features line up; the lookup gives it no TBE), each with the
        whole table's global metadata, so checkpoints and the fused optimizer see one table."""
        world = _compat.rw_sharding_setup(self).world_size
        per_rank: List[list] = [[] for _ in range(world)]
        for info in sharding_infos:
            c, ps = info.embedding_config, info.param_sharding
            slices = slices_of(c.name, ps, c.num_embeddings, c.embedding_dim, world)
            shards: List[ShardMetadata] = ps.sharding_spec.shards  # type: ignore[union-attr]
            if is_row_layout(shards, world):
                for r, tables in enumerate(stock_shard([info])):
                    per_rank[r].extend(tables)
                continue
            whole = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([c.num_embeddings, c.embedding_dim]))
            for sl, shard in zip(slices, shards):
                device = str(shard.placement).split("/", 1)[1]
                blocks = [ShardMetadata(shard_offsets=[sl.bounds[r], sl.offset],
                                        shard_sizes=[sl.bounds[r + 1] - sl.bounds[r], sl.width],
                                        placement=f"rank:{r}/{device}") for r in range(world)]
                one = dataclasses.replace(info, param_sharding=dataclasses.replace(
                    ps, sharding_spec=EnumerableShardingSpec(blocks)))
                for r, tables in enumerate(stock_shard([one])):
                    per_rank[r].extend(dataclasses.replace(t, local_cols=sl.width, global_metadata=whole)
                                       for t in tables)
        return per_rank

    def _slice_dims(self) -> List[int]:
        """Output width of each feature as the data path sees it (a slice's width per slice)."""
        return [t.local_cols for t in self._tables for _ in range(t.num_features())]

    def _merged(self) -> List[tuple]:
        """Per output feature ``(name, dim, metadata, slice features)``: a column-wise table's
        slices of one feature merged back into one feature of the full width, in the order of
        their first slice (set-up time)."""
        out: Dict[str, tuple] = {}
        names = [n for g in _compat.sharding_grouped_configs(self) for n in g.embedding_names()]
        meta = [m for g in _compat.sharding_grouped_configs(self) for m in g.embedding_shard_metadata()]
        for f, (name, dim, m) in enumerate(zip(names, self._slice_dims(), meta)):
            n, d, m0, parts = out.get(name, (name, 0, m, []))
            out[name] = (n, d + dim, m0, parts + [(m.shard_offsets[1] if m is not None else 0, f)])
        return list(out.values())

    def embedding_names(self) -> List[str]:
        return [m[0] for m in self._merged()]

    def embedding_dims(self) -> List[int]:
        return [m[1] for m in self._merged()]

    def embedding_shard_metadata(self) -> List[Optional[ShardMetadata]]:
        return [m[2] for m in self._merged()]

    def _column_order(self) -> Optional[List[int]]:
        """The output dist's column permutation from slice features to merged features (None:
        the slices of every feature are already side by side in column order)."""
        dims = self._slice_dims()
        starts = [sum(dims[:f]) for f in range(len(dims))]
        order = [starts[f] + i for m in self._merged() for _, f in sorted(m[3]) for i in range(dims[f])]
        return None if order == list(range(len(order))) else order

    @property
    def hybrid_pg(self) -> dist.ProcessGroup:
        """The sharding's process group, that of its cold exchange (torchrec types it Optional; a
        hybrid sharding always has one; under 2D parallelism the sharding sub-group)."""
        pg = self._setup.pg
        assert pg is not None, "a frequency_hybrid sharding needs a process group"
        return pg

    def _build_state(self, hot_ids_per_group, device: torch.device, version: int) -> HotState:
        groups = _compat.sharding_grouped_configs(self)
        it = iter(self._bounds)
        bounds = [[next(it) for _ in g.embedding_tables] for g in groups]
        return build_hot_state(groups, hot_ids_per_group, bounds, self._setup.world_size, self._setup.rank, device,
                               version)

    def hot_state(self, device: Optional[torch.device] = None) -> HotState:
        """The current hot set (built once, then replaced by :meth:`refresh`)."""
        if self._state is None:
            device = device if device is not None else self._setup.device
            self._state = self._build_state(self._hot_ids_per_group, device, 0)
        return self._state

    def hot_ids(self) -> Dict[str, torch.Tensor]:
        """The current sorted hot ids per table."""
        state = self.hot_state()
        return {t.name: ids for t, ids in zip(self._tables, state.hot_ids)}

    def refresh(self, hot_ids: Mapping[str, torch.Tensor]) -> HotState:
        """Replaces the hot set from the next input dist on: ``hot_ids`` (validated, sorted,
        the same on every rank) for some or all of this sharding's tables; the others keep
        theirs. No weights or optimizer state move: every row stays in its owner's shard.
        Steps already split by the old set finish with it (each input carries its state)."""
        old = self.hot_state()
        current = self.hot_ids()
        unknown = sorted(set(hot_ids) - set(current))
        if unknown:
            raise ValueError(f"refresh: tables {unknown} are not frequency_hybrid tables of this sharding "
                             f"(its tables: {sorted(current)})")
        groups = _compat.sharding_grouped_configs(self)
        per_group = [[hot_ids.get(t.name, current[t.name]).to(torch.int64).cpu() for t in g.embedding_tables]
                     for g in groups]
        device = old.layout.owner.device
        state = self._build_state(per_group, device, old.version + 1)
        self._hot_ids_per_group = per_group
        self._state = state
        for d in self._input_dists:
            d.set_hot_state(state)
        return state

    def cold_exchanges(self) -> List[ColdIdsAllToAll]:
        """The cold ids' all-to-all of each input dist this sharding made (their rooms and spills)."""
        return [d.cold_exchange for d in self._input_dists]

    def _feature_tables(self) -> List[int]:
        return [i for i, t in enumerate(self._tables) for _ in range(t.num_features())]

    def lanes(self, device: torch.device) -> tuple:
        """The owner's cold lookup as lanes (lookup.lanes_of): heavy tables' features looked up as W virtual
        features, or, multi-hot, in a TBE call of their own. Worked out once; the lookup runs them and the
        input dist unpacks what arrives into them."""
        if self._lanes is None:
            setup = self._setup
            rank = setup.rank
            heavy = heavy_tables(setup.world_size, [b[rank + 1] - b[rank] for b in self._bounds],
                                 [t.num_embeddings for t in self._tables])
            # a table's column slices share one TBE (its fused optimizer holds all of the table's local shards)
            heavy_names = {t.name for t, h in zip(self._tables, heavy) if h}
            lanes = {i for i, t in enumerate(self._tables) if t.name in heavy_names}
            groups = _compat.sharding_grouped_configs(self)
            group_of = [g for g in groups for _ in g.embedding_tables]  # per table (self._tables order)
            multi_hot = {i for i in lanes if own_lane_pays(group_of[i], self._tables[i].num_features(),
                                                           self._pooling.get(self._tables[i].name),
                                                           torch.device(device))}
            self._lanes = lanes_of(groups, lanes, setup.world_size, multi_hot, torch.device(device))
        return self._lanes

    def create_input_dist(self, device: Optional[torch.device] = None) -> HybridSparseFeaturesDist:
        device = device if device is not None else self._setup.device
        feature_tables = self._feature_tables()
        rows = [t.num_embeddings for t in self._tables]
        _, layout, keys = self.lanes(device)
        dist_ = HybridSparseFeaturesDist(
            pg=self.hybrid_pg,
            feature_tables=feature_tables,
            table_rows=rows,
            state=self.hot_state(device),
            row_bounds=[self._bounds[i] for i in feature_tables],
            device=device,
            lanes=layout,
            lane_keys=keys,
            exchange_touched=self._exchange_touched,
            feature_dims=self._slice_dims(),
        )
        self._input_dists.append(dist_)
        return dist_

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor: Any = None) -> HybridLookup:
        device = device if device is not None else self._setup.device
        lane_configs, _, _ = self.lanes(device)
        return HybridLookup(lane_configs, pg=self.hybrid_pg, device=device, env=self._setup.env)

    def create_output_dist(self, device: Optional[torch.device] = None) -> HybridPooledEmbeddingDist:
        mean = [self._tables[i].pooling == PoolingType.MEAN for i in self._feature_tables()]
        device = device if device is not None else self._setup.device
        codecs = (self.qcomm_codecs_registry or {}).get(OUTPUT_COMM_OP)
        return HybridPooledEmbeddingDist(self.hybrid_pg, self._slice_dims(), mean, device, codecs,
                                         column_order=self._column_order())
