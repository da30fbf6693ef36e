"""Every private TorchRec / FBGEMM / PyTorch name this package touches, in one place.

TorchRec 1.8 and FBGEMM 1.8 expose no public API for these; if an upgrade renames one,
this is the only file to change. ``tests/test_compat.py`` fails if a private name of
torch, torchrec or fbgemm_gpu is used anywhere else in the package.
"""

from typing import Callable, List, NamedTuple, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, ShardingEnv

# --- TorchRec awaitables ------------------------------------------------------------------


_W = TypeVar("_W")


class HybridAwaitable(Awaitable[_W]):
    """TorchRec's ``Awaitable`` whose value :meth:`result` computes when waited on: TorchRec's own
    awaitables implement the private ``Awaitable._wait_impl`` (checked against torchrec 1.8.0), ours this."""

    def _wait_impl(self) -> _W:
        return self.result()

    def result(self) -> _W:
        raise NotImplementedError


# --- TorchRec embedding shardings ---------------------------------------------------------


class RwShardingSetup(NamedTuple):
    """What a stock row-wise sharding derived from its ShardingEnv and device."""

    env: ShardingEnv
    pg: Optional[dist.ProcessGroup]  # the sharding's group (a 2D env's sharding_pg)
    rank: int
    world_size: int
    device: torch.device  # cpu when the sharding was built with device=None


def rw_sharding_setup(sharding) -> RwShardingSetup:
    """``_env``, ``_pg``, ``_rank``, ``_world_size``, ``_device`` of a ``BaseRwEmbeddingSharding``
    (checked against torchrec 1.8.0)."""
    return RwShardingSetup(sharding._env, sharding._pg, sharding._rank, sharding._world_size, sharding._device)


class RwPooledShardingWithTables(RwPooledEmbeddingSharding):
    """``RwPooledEmbeddingSharding`` whose tables per rank come from :meth:`shard_tables`
    (TorchRec computes them in the private ``_shard``, called by ``__init__``; checked
    against torchrec 1.8.0), so a subclass can cut a table in column slices."""

    def shard_tables(self, sharding_infos: list, stock_shard: Callable[[list], list]) -> list:
        """Per rank, its ``ShardedEmbeddingTable``s; ``stock_shard(infos)`` is TorchRec's."""
        return stock_shard(sharding_infos)

    def _shard(self, sharding_infos):
        return self.shard_tables(sharding_infos, super()._shard)


def sharding_grouped_configs(sharding) -> list:
    """The GroupedEmbeddingConfigs a stock row-wise sharding computed for this rank
    (``_grouped_embedding_configs``; checked against torchrec 1.8.0)."""
    return sharding._grouped_embedding_configs


# --- TorchRec ShardedEmbeddingBagCollection -----------------------------------------------


def sebc_shardings(sebc) -> list:
    """The embedding shardings of a ShardedEmbeddingBagCollection, one per sharding type
    (``_embedding_shardings``; checked against torchrec 1.8.0)."""
    return sebc._embedding_shardings


def sebc_fix_mean_pooling(sebc) -> None:
    """Make SEBC's MEAN-pooling callback divide exactly the stock row-wise MEAN features
    (``_pooling_type_to_rs_features``, ``_embedding_bag_configs``, ``_has_mean_pooling_callback``;
    checked against torchrec 1.8.0).

    The stock divisor divides every feature *not* listed under "SUM" (a stock bug when a
    row-wise MEAN table shares an EBC with other types), so we list every other feature there.
    Hybrid features are divided in their own output dist and are never listed as MEAN.
    """
    if "MEAN" not in sebc._pooling_type_to_rs_features:
        return
    divided = set(sebc._pooling_type_to_rs_features["MEAN"])
    all_features = [f for c in sebc._embedding_bag_configs for f in c.feature_names]
    sebc._pooling_type_to_rs_features["SUM"] = sorted(set(all_features) - divided)
    sebc._pooling_type_to_rs_features["MEAN"] = sorted(divided)
    if not divided:
        del sebc._pooling_type_to_rs_features["MEAN"]
    sebc._has_mean_pooling_callback = bool(divided)


# --- FBGEMM quantized comms ---------------------------------------------------------------


def qcomm_codec_setting(codec) -> Optional[str]:
    """What an FBGEMM ``QuantizedCommCodec`` was configured as, e.g. ``"FP8 rowwise (row_dim
    32)"`` (``_comm_precision``, ``_row_dim``; checked against fbgemm_gpu 1.8); None for any
    other codec."""
    precision = getattr(codec, "_comm_precision", None)
    if precision is None:
        return None
    name = getattr(precision, "name", str(precision))
    row_dim = getattr(codec, "_row_dim", -1)
    if name == "FP8":
        return f"FP8 rowwise (row_dim {row_dim})" if row_dim > 0 else "FP8 (element-wise)"
    if name == "MX4":
        return f"MX4 (groups of {row_dim})"
    if name == "INT8":
        return "INT8 rowwise"
    return name


# --- TorchRec planner ---------------------------------------------------------------------


def optimizer_classes_in_backward(tensor) -> list:
    """The optimizer classes ``apply_optimizer_in_backward`` set on a parameter (``_optimizer_classes``,
    where TorchRec's storage estimator reads them; checked against torchrec 1.8.0); [] if none."""
    return list(getattr(tensor, "_optimizer_classes", None) or [])


def planner_reserved_topology(planner, module, sharders):
    """The Topology whose device caps an EmbeddingShardingPlanner's partitioner packs shards into: its
    storage reservation (``_storage_reservation``, e.g. 15% of each device plus dense and KJT memory)
    applied to its topology, with its constraints (``_constraints``), as its ``plan`` does (checked
    against torchrec 1.8.0)."""
    return planner._storage_reservation.reserve(topology=planner._topology, batch_size=planner._batch_size,
                                                module=module, sharders=sharders, constraints=planner._constraints)


def planner_best_plan(planner) -> list:
    """The ShardingOptions of an EmbeddingShardingPlanner's last plan (``_best_plan``;
    checked against torchrec 1.8.0)."""
    return list(planner._best_plan or [])


def planner_perf_model(planner):
    """The performance model a TorchRec planner rates proposals with (private attribute)."""
    return planner._perf_model


def planner_topology(planner):
    """The Topology an EmbeddingShardingPlanner plans for (``_topology``; checked against
    torchrec 1.8.0)."""
    return planner._topology


def topology_with_comms_bandwidths(topology, comms_bandwidths):
    """``topology`` (a copy the caller made) with other comms bandwidths (``_comms_bandwidths``,
    what ``Topology.comms_bandwidths`` returns; checked against torchrec 1.8.0): Topology has no
    public setter, and its constructor does not take back every field it holds (``pod_size``,
    the factory flag), so a rebuilt one would not be the user's."""
    topology._comms_bandwidths = comms_bandwidths
    return topology


def planner_batch_size(planner) -> int:
    """The local batch size an EmbeddingShardingPlanner plans for (``_batch_size``; checked
    against torchrec 1.8.0)."""
    return planner._batch_size


def set_planner_perf_model(planner, perf_model) -> None:
    """Replace the performance model an EmbeddingShardingPlanner rates proposals with
    (``_perf_model``; checked against torchrec 1.8.0)."""
    planner._perf_model = perf_model


def set_planner_enumerator(planner, enumerator) -> None:
    """Replace an EmbeddingShardingPlanner's enumerator (``_enumerator``; checked against
    torchrec 1.8.0): its constructor builds a stock one from its own constraints when given none."""
    planner._enumerator = enumerator


def enumerator_sharder_data_map(enumerator) -> dict:
    """The per-sharder data an EmbeddingEnumerator built in ``enumerate`` (``_sharder_data_map``;
    checked against torchrec 1.8.0)."""
    return enumerator._sharder_data_map


# --- TorchRec planner stats ---------------------------------------------------------------


def stats_table(stats: EmbeddingStats) -> Tuple[List[str], int]:
    """The lines an EmbeddingStats logged and its box width (``_stats_table``, ``_width``;
    checked against torchrec 1.8.0)."""
    return stats._stats_table, stats._width


class EmbeddingStatsWithShardIO(EmbeddingStats):
    """``EmbeddingStats`` whose per-shard input/output sizes a subclass may answer through
    :meth:`shard_io_sizes` (overrides ``_get_shard_stats``; checked against torchrec 1.8.0)."""

    def shard_io_sizes(self, shard, sharding_option, world_size, local_world_size, constraints):
        """``(ranks, input MB per rank, output MB per rank)``, or None for the stock answer."""
        return None

    def _get_shard_stats(self, shard, sharding_option, world_size, local_world_size, constraints=None):
        mine = self.shard_io_sizes(shard, sharding_option, world_size, local_world_size, constraints)
        if mine is not None:
            return mine
        return super()._get_shard_stats(shard, sharding_option, world_size, local_world_size, constraints)


def grouped_lookup_forward(lookup, features_by_group: list) -> list:
    """Pooled outputs of a ``GroupedPooledEmbeddingsLookup``, one per group, each group's KJT
    with its own batch (``_forward``: the stock ``forward`` splits one KJT, one batch for all;
    checked against torchrec 1.8.0)."""
    return lookup._forward(features_by_group)


# --- PyTorch: a load_state_dict pre-hook that runs before the module's own ------------------


def add_first_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable) -> None:
    """Registers ``hook(module, state_dict, prefix, ...)`` (``Module.register_load_state_dict_pre_hook``)
    and moves it ahead of the hooks already there (TorchRec's SEBC slices full tables into its
    shards in one; torch runs pre-hooks in registration order and offers no public ``prepend``)."""
    handle = module.register_load_state_dict_pre_hook(hook)
    hooks = module._load_state_dict_pre_hooks  # an ordered dict: re-inserted with ours first
    others = {k: v for k, v in hooks.items() if k != handle.id}
    ours = hooks[handle.id]
    hooks.clear()
    hooks[handle.id] = ours
    hooks.update(others)
