"""The model's estimate of bytes sent per rank per step, for a measured configuration.

The only place the benchmarks touch the cost model (torchrec_hybrid/planner/cost_model.py):
per table it prices the table's planned sharding type from the table shape, the ids per bag
and, for frequency_hybrid, the hot coverage measured by `FrequencyStats` on the statistics
batches. Added here: the DDP all-reduce of DLRM's dense MLPs (a ring all-reduce, priced like
a data-parallel table); the module's overhead is the cost model's for the planned types. The hybrid
planner's plans (``hybrid_planner*``) carry the planner's own estimate of the plan it returned.
"""

from typing import Dict, Mapping, Sequence

from torchrec_hybrid.planner import cost_model as cm


def expected_bytes(table_types: Mapping[str, Sequence], rows: Mapping[str, int], dim: int,
                   hotness: Mapping[str, int], batch: int, world: int, cold_fraction: Mapping[str, float],
                   hot_rows: Mapping[str, int], dense_numel: int = 0, gloo: bool = False) -> float:
    """Bytes per rank per step of one model; ``table_types[t] = [sharding_type, shards]``.

    One feature per table; ``hotness[t]`` ids per bag; cold_fraction / hot_rows per table;
    ``gloo``: collectives as gloo implements them.
    """
    total = 0.0
    for name, (kind, shards) in table_types.items():
        t = cm.TableTraffic(rows=rows[name], dim=dim, features=1, pooling=float(hotness[name]),
                            batch=batch, world=world)
        if kind == cm.FREQUENCY_HYBRID:
            total += float(cm.HYBRID.mean_bytes(t, 1.0 - cold_fraction[name], hot_rows[name]))
        else:
            total += cm.model(kind).mean_bytes(t, shards=max(1, shards), gloo=gloo)
    total += dense_bytes(dense_numel, batch, world)
    types = {kind for kind, _ in table_types.values()}  # one sharded module; only the hybrid sharder checks ids
    return total + cm.module_overhead_bytes(world, types, validate_ids=cm.FREQUENCY_HYBRID in types)


def dense_bytes(dense_numel: int, batch: int, world: int) -> float:
    """The DDP all-reduce of ``dense_numel`` parameters outside the EBC, per rank per step."""
    if not dense_numel:
        return 0.0
    return cm.model(cm.DATA_PARALLEL).mean_bytes(cm.TableTraffic(dense_numel, 1, 1, 1.0, batch, world))


def expected_for(raw: Dict, kind: str, dim: int, batch: int, world: int, gloo: bool = False) -> float:
    """`expected_bytes` for sharding type `kind` from one rank's raw result (measure.py); for a
    hybrid planner's plan, the planner's own estimate (plus the dense all-reduce)."""
    planned = raw.get("planner_estimates", {}).get(kind)
    if planned is not None:
        return planned + dense_bytes(raw["dense_numel"], batch, world)
    hotness = dict(zip(raw["rows_per_table"], raw["hotness"]))
    return expected_bytes(raw["table_types"][kind], raw["rows_per_table"], dim, hotness, batch,
                          world, raw["cold_fraction"], raw["hot_rows_per_table"], raw["dense_numel"], gloo=gloo)

