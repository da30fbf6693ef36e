"""The frequency-hybrid embedding sharding: composition of input dist, lookup, output dist.

The row layout is a stock row-wise one (``RwPooledEmbeddingSharding`` computes it from the
plan): every table is split in contiguous row blocks, one per rank, even or not, possibly
empty (row_blocks.py: even blocks, blocks of equal lookup cost, or every row on one rank -
the table-wise cold layout), and the cold lookups go to the owner of their block. The hot
rows are also replicated on every rank, as copies their owners refresh every step
(hot_replica.py). Because the cold shard is the only home of every row, state_dict,
checkpoints and the fused optimizer state are exactly stock row-wise. Quantized comms: the
``POOLED_EMBEDDINGS_ALL_TO_ALL`` codecs of ``qcomm_codecs_registry`` encode the output
all-to-all (FP16 / BF16; output_dist.py), the only hybrid collective that carries floats.
"""

from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.cells import heavy_tables
from torchrec_hybrid.sharding.hot_replica import zero_grad_is_noop
from torchrec_hybrid.sharding.hot_state import HotState, build_hot_state
from torchrec_hybrid.sharding.input_dist import HybridSparseFeaturesDist
from torchrec_hybrid.sharding.lookup import HybridLookup
from torchrec_hybrid.sharding.output_dist import OUTPUT_COMM_OP, HybridPooledEmbeddingDist, describe_codec_problems
from torchrec_hybrid.sharding.row_blocks import bounds_of


class HybridPooledEmbeddingSharding(RwPooledEmbeddingSharding):
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
        self._tables = [t for g in groups for t in g.embedding_tables]
        self._hot_ids_per_group = [[hot_ids[t.name] for t in g.embedding_tables] for g in groups]
        world, rank = self._setup.world_size, self._setup.rank
        specs = {i.embedding_config.name: i for i in sharding_infos}
        self._bounds = {}  # row bounds per table: the owner blocks the input dist bucketizes by
        for t in self._tables:
            info = specs[t.name]
            self._bounds[t.name] = bounds_of(t.name, info.param_sharding, t.num_embeddings, t.embedding_dim, world)
            if t.local_metadata.shard_offsets[0] != self._bounds[t.name][rank]:
                raise RuntimeError(f"table '{t.name}': local shard at row {t.local_metadata.shard_offsets[0]}, "
                                   f"plan says {self._bounds[t.name][rank]}")
        # Owners send every hot row each step unless a zero-gradient update could change a
        # row (weight decay, Adam, ...): then only rows some rank looked up, and the input
        # dist gathers which those are.
        self._exchange_touched = not all(zero_grad_is_noop(g.fused_params) for g in groups)
        self._state: Optional[HotState] = None
        self._input_dists: List[HybridSparseFeaturesDist] = []

    @property
    def _hybrid_pg(self) -> dist.ProcessGroup:
        """The sharding's process group (torchrec types it Optional; a hybrid sharding always has one)."""
        pg = self._setup.pg
        assert pg is not None, "a frequency_hybrid sharding needs a process group"
        return pg

    def _build_state(self, hot_ids_per_group, device: torch.device, version: int) -> HotState:
        groups = _compat.sharding_grouped_configs(self)
        bounds = [[self._bounds[t.name] for t in g.embedding_tables] for g in groups]
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

    def _feature_tables(self) -> List[int]:
        return [i for i, t in enumerate(self._tables) for _ in range(t.num_features())]

    def create_input_dist(self, device: Optional[torch.device] = None) -> HybridSparseFeaturesDist:
        device = device if device is not None else self._setup.device
        feature_tables = self._feature_tables()
        rows = [t.num_embeddings for t in self._tables]
        dist_ = HybridSparseFeaturesDist(
            pg=self._hybrid_pg,
            feature_tables=feature_tables,
            table_rows=rows,
            state=self.hot_state(device),
            row_bounds=[self._bounds[self._tables[i].name] for i in feature_tables],
            device=device,
            exchange_touched=self._exchange_touched,
            feature_dims=self.embedding_dims(),
        )
        self._input_dists.append(dist_)
        return dist_

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor: Any = None) -> HybridLookup:
        setup = self._setup
        device = device if device is not None else setup.device
        rank = setup.rank
        heavy = heavy_tables(setup.world_size, [self._bounds[t.name][rank + 1] - self._bounds[t.name][rank]
                                                for t in self._tables], [t.num_embeddings for t in self._tables])
        return HybridLookup(_compat.sharding_grouped_configs(self), pg=self._hybrid_pg, device=device,
                            env=setup.env, heavy_tables={t.name for t, h in zip(self._tables, heavy) if h})

    def create_output_dist(self, device: Optional[torch.device] = None) -> HybridPooledEmbeddingDist:
        mean = [self._tables[i].pooling == PoolingType.MEAN for i in self._feature_tables()]
        device = device if device is not None else self._setup.device
        codecs = (self.qcomm_codecs_registry or {}).get(OUTPUT_COMM_OP)
        return HybridPooledEmbeddingDist(self._hybrid_pg, self.embedding_dims(), mean, device, codecs)
