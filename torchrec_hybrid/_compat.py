"""Every private TorchRec / FBGEMM / PyTorch attribute this package touches, in one place.

TorchRec 1.8 and FBGEMM 1.8 expose no public API for these; if an upgrade renames one,
this is the only file to change.
"""


# --- TorchRec internals -------------------------------------------------------------------

def sharding_grouped_configs(sharding) -> list:
    """The GroupedEmbeddingConfigs a stock row-wise sharding computed for this rank."""
    return sharding._grouped_embedding_configs


def sebc_lookups(sebc) -> list:
    return sebc._lookups


def sebc_fix_mean_pooling(sebc, divided_after_dist: set) -> None:
    """Wire SEBC's MEAN-pooling callback so it divides exactly ``divided_after_dist``.

    The stock divisor divides every feature *not* listed under "SUM" (a stock bug when a
    row-wise MEAN table shares an EBC with other types), so we list every other feature there.
    """
    if "MEAN" not in sebc._pooling_type_to_rs_features:
        return
    all_features = [f for c in sebc._embedding_bag_configs for f in c.feature_names]
    sebc._pooling_type_to_rs_features["SUM"] = sorted(set(all_features) - divided_after_dist)
    sebc._pooling_type_to_rs_features["MEAN"] = sorted(divided_after_dist)
    if not divided_after_dist:
        del sebc._pooling_type_to_rs_features["MEAN"]
    sebc._has_mean_pooling_callback = bool(divided_after_dist)


# --- TorchRec planner internals (checked against torchrec 1.8.0) --------------------------

def planner_best_plan(planner) -> list:
    """The ShardingOptions of an EmbeddingShardingPlanner's last plan (``_best_plan``)."""
    return list(planner._best_plan or [])


def planner_topology(planner):
    """The Topology an EmbeddingShardingPlanner plans for (``_topology``)."""
    return planner._topology


def planner_batch_size(planner) -> int:
    """The local batch size an EmbeddingShardingPlanner plans for (``_batch_size``)."""
    return planner._batch_size


def set_planner_enumerator(planner, enumerator) -> None:
    """Replace an EmbeddingShardingPlanner's enumerator (``_enumerator``): its constructor
    builds a stock one from its own constraints when given none."""
    planner._enumerator = enumerator
