"""The frequency-hybrid embedding sharding: composition of input dist, lookup, output dist.

The row layout is a stock row-wise one (``RwPooledEmbeddingSharding`` computes it from the
plan): every table is split in contiguous row blocks, one per rank, even or not, possibly
empty (row_blocks.py: even blocks, blocks of equal lookup cost, or every row on one rank -
the table-wise cold layout), and the cold lookups go to the owner of their block. The hot
rows are also replicated on every rank, as copies their owners refresh every step
(hot_replica.py). Because the cold shard is the only home of every row, state_dict,
checkpoints and the fused optimizer state are exactly stock row-wise.
"""

from typing import Any, Dict, List, Mapping, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType

from torchrec_hybrid import _compat
from torchrec_hybrid.sharding.cells import feature_copies
from torchrec_hybrid.sharding.hot_replica import HotReplica, HotRowLayout, zero_grad_is_noop
from torchrec_hybrid.sharding.input_dist import HybridSparseFeaturesDist, IdCheckCarrier
from torchrec_hybrid.sharding.lookup import HybridLookup
from torchrec_hybrid.sharding.output_dist import HybridPooledEmbeddingDist
from torchrec_hybrid.sharding.row_blocks import bounds_of, even_bounds


class HybridPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Frequency-hybrid sharding of pooled tables (one instance per EBC, all hybrid tables).

    Args:
        sharding_infos / env / device / qcomm_codecs_registry: as for stock shardings.
        hot_ids: validated, sorted int64 hot row ids per table name.
        id_check: where the sharded module leaves its id-check report for the cold all-to-all.
    """

    def __init__(
        self,
        sharding_infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
        hot_ids: Mapping[str, torch.Tensor],
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
        id_check: Optional[IdCheckCarrier] = None,
    ) -> None:
        super().__init__(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        self._id_check = id_check
        groups = _compat.sharding_grouped_configs(self)
        self._tables = [t for g in groups for t in g.embedding_tables]
        self._hot_ids_per_group = [[hot_ids[t.name] for t in g.embedding_tables] for g in groups]
        world = self._world_size
        specs = {i.embedding_config.name: i for i in sharding_infos}
        self._bounds = {}  # row bounds per table: the owner blocks the input dist bucketizes by
        for t in self._tables:
            info = specs[t.name]
            self._bounds[t.name] = bounds_of(t.name, info.param_sharding, t.num_embeddings, t.embedding_dim, world)
            if t.local_metadata.shard_offsets[0] != self._bounds[t.name][self._rank]:
                raise RuntimeError(f"table '{t.name}': local shard at row {t.local_metadata.shard_offsets[0]}, "
                                   f"plan says {self._bounds[t.name][self._rank]}")
        # Owners send every hot row each step unless a zero-gradient update could change a
        # row (weight decay, Adam, ...): then only rows some rank looked up, and the input
        # dist gathers which those are.
        self._exchange_touched = not all(zero_grad_is_noop(g.fused_params) for g in groups)
        self._hot_parts = None

    def _hot(self, device: torch.device):
        """The groups' replicas and the hot-row layout (built once, shared by all three parts).

        Hot slots are numbered group after group, each group's as its replica stores them.
        """
        if self._hot_parts is None:
            groups = _compat.sharding_grouped_configs(self)
            replicas, base = [], 0
            for g, ids in zip(groups, self._hot_ids_per_group):  # set-up time loop over groups
                replicas.append(HotReplica(g, ids, device, slot_base=base))
                base += replicas[-1].num_slots
            bounds = [[self._bounds[t.name] for t in g.embedding_tables] for g in groups]
            layout = HotRowLayout(replicas, bounds, self._hot_ids_per_group, self._world_size, self._rank)
            self._hot_parts = (replicas, layout.to(device))
        return self._hot_parts

    def _feature_tables(self) -> List[int]:
        return [i for i, t in enumerate(self._tables) for _ in range(t.num_features())]

    def create_input_dist(self, device: Optional[torch.device] = None) -> HybridSparseFeaturesDist:
        world = self._world_size
        device = device if device is not None else self._device
        feature_tables = self._feature_tables()
        rows = [t.num_embeddings for t in self._tables]
        replicas, _ = self._hot(device)
        return HybridSparseFeaturesDist(
            pg=self._pg,
            feature_tables=feature_tables,
            table_rows=rows,
            hot_ids=[h for group in self._hot_ids_per_group for h in group],
            hot_slot_starts=[r.slot_base + s for r in replicas for s in r.table_slot_start],
            row_bounds=[self._bounds[self._tables[i].name] for i in feature_tables],
            device=device,
            exchange_touched=self._exchange_touched,
            id_check=self._id_check,
        )

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor: Any = None) -> HybridLookup:
        device = device if device is not None else self._device
        replicas, layout = self._hot(device)
        rank, tables = self._rank, [self._tables[i] for i in self._feature_tables()]
        copies = None
        # FBGEMM's CPU row-wise Adagrad takes a fast path for a table with one feature that
        # drops L2 weight decay, while tables with several features apply it: copies would
        # then change the update, so with weight decay every feature keeps one copy.
        if not any(float((g.fused_params or {}).get("weight_decay", 0.0) or 0.0)
                   for g in _compat.sharding_grouped_configs(self)):
            copies = feature_copies(self._world_size, [self._bounds[t.name][rank + 1] - self._bounds[t.name][rank]
                                                       for t in tables], [t.num_embeddings for t in tables])
        return HybridLookup(_compat.sharding_grouped_configs(self), replicas, layout, pg=self._pg, device=device,
                            env=self._env, copies=copies)

    def create_output_dist(self, device: Optional[torch.device] = None) -> HybridPooledEmbeddingDist:
        mean = [self._tables[i].pooling == PoolingType.MEAN for i in self._feature_tables()]
        device = device if device is not None else self._device
        return HybridPooledEmbeddingDist(self._pg, self.embedding_dims(), mean, device, self._hot(device)[1])
