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
