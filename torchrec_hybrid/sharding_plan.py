"""Hand-written plans: a ``frequency_hybrid()`` generator for ``construct_module_sharding_plan``,
and ``check_hot_ids``: user-given hot ids against the tables and the plan."""

import math
import numbers
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise
from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardingPlan, ShardMetadata

from torchrec_hybrid import row_blocks
from torchrec_hybrid.types import FREQUENCY_HYBRID, HotSetError, HybridParameterSharding


def hybrid_spec(slices: Sequence[row_blocks.ColumnSlice], placements: Sequence[Any]
                ) -> EnumerableShardingSpec:
    """The sharding spec of a frequency_hybrid table: per column slice, one row block per rank
    (``placements[r]``) as the slice's bounds say (row_blocks.py)."""
    return EnumerableShardingSpec([
        ShardMetadata(shard_offsets=[sl.bounds[r], sl.offset], shard_sizes=[sl.bounds[r + 1] - sl.bounds[r], sl.width],
                      placement=p)
        for sl in slices for r, p in enumerate(placements)
    ])


def _int_list(what: str, values: Any) -> Optional[list]:
    """``ranks`` / ``row_bounds`` as a list (a sequence, or a 1-D integer tensor / array, e.g. from
    ``row_blocks.balanced_bounds``); anything else is refused naming the argument."""
    if values is None:
        return None
    if isinstance(values, (list, tuple)):
        return list(values)
    kind = getattr(getattr(values, "dtype", None), "kind", None)  # a NumPy array's: "i" / "u" for integers
    integer = (not values.is_floating_point() and not values.is_complex() if isinstance(values, torch.Tensor)
               else kind in ("i", "u"))
    if integer and getattr(values, "ndim", 0) == 1:
        return list(values.tolist())
    raise ValueError(f"frequency_hybrid({what}={values!r}): expected a list of ints >= 0")


def frequency_hybrid(compute_kernel: str = "fused", cold: str = row_blocks.ROW_WISE, rank: Optional[int] = None,
                     row_bounds: Optional[Sequence[int]] = None, ranks: Optional[Sequence[int]] = None,
                     pooling_factor: Optional[float] = None):
    """Like TorchRec's ``row_wise()`` / ``table_wise(rank)`` / ``column_wise(ranks)``, for
    frequency_hybrid tables.

    Hot rows are looked up locally on every rank whatever the cold layout. Cold rows:
    - ``cold="row_wise"`` (default): stock even row blocks on all ranks, or ``row_bounds``
      (``[0, b_1, ..., rows]``, one block per rank, e.g. ``row_blocks.balanced_bounds``);
    - ``cold="table_wise", rank=k``: every row on rank k (a bag's cold ids return one
      partial sum, as table_wise; best for multi-hot bags); each other rank keeps one row
      (row_blocks.py), except for a table with fewer rows than ranks, which is written as
      stock table_wise writes it (one shard on k);
    - ``cold="column_wise", ranks=[k_0, ...]``: the columns cut in ``len(ranks)`` slices as
      stock column_wise cuts them, slice s laid out table-wise on rank ``k_s`` (for tables
      too big or too hot for one rank).

    ``pooling_factor``: ids per sample of the table's bags, as TorchRec's
    ``ParameterConstraints.pooling_factors`` give it (the planner writes its own: the
    constraints', else measured from the statistics). With 2 or more, a rank holding most of
    the table's cold rows (table-wise cold, a column slice, a large uneven block) looks it up
    in a TBE call of its own, which FBGEMM's CPU backward runs far faster on multi-hot bags
    (on the CPU, with row-wise AdaGrad and one feature: lookup.py ``own_lane_pays``).
    """
    if compute_kernel != EmbeddingComputeKernel.FUSED.value:  # what sharding runs hybrid tables on
        raise ValueError(f"frequency_hybrid(compute_kernel={compute_kernel!r}): frequency_hybrid runs on 'fused' "
                         "only (no UVM / caching / key-value kernels)")
    if cold not in row_blocks.COLD_LAYOUTS:
        raise ValueError(f"cold layout {cold!r} is not one of {list(row_blocks.COLD_LAYOUTS)}")
    ranks, row_bounds = _int_list("ranks", ranks), _int_list("row_bounds", row_bounds)
    if cold == row_blocks.TABLE_WISE and (rank is None or row_bounds is not None):
        raise ValueError("cold='table_wise' needs rank=<owner> and no row_bounds")
    if cold == row_blocks.COLUMN_WISE and (not ranks or rank is not None or row_bounds is not None):
        raise ValueError("cold='column_wise' needs ranks=[owner of each column slice] and no rank or row_bounds")
    if cold != row_blocks.COLUMN_WISE and ranks is not None:
        raise ValueError("ranks= is for cold='column_wise'")
    if cold == row_blocks.ROW_WISE and rank is not None:
        raise ValueError("rank= is for cold='table_wise'; a row-wise cold layout spans every rank")
    if pooling_factor is not None and (isinstance(pooling_factor, bool) or not isinstance(pooling_factor, numbers.Real)
                                       or not math.isfinite(pooling_factor) or not pooling_factor > 0):
        raise ValueError(f"frequency_hybrid(pooling_factor={pooling_factor!r}): expected a finite number > 0")
    for what, values in (("rank", [] if rank is None else [rank]), ("ranks", list(ranks or [])),
                         ("row_bounds", list(row_bounds or []))):
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 for v in values):
            raise ValueError(f"frequency_hybrid({what}={rank if what == 'rank' else values!r}): expected "
                             f"{'an int' if what == 'rank' else 'ints'} >= 0")
    given = (("rank", rank), ("ranks", ranks), ("row_bounds", row_bounds))
    call = f"frequency_hybrid(cold={cold!r}" + "".join(f", {k}={v!r}" for k, v in given if v is not None) + ")"
    stock = row_wise(compute_kernel=compute_kernel)

    def _generator(param, local_size, world_size, device_type, sharder) -> ParameterSharding:
        ps = _sharding(param, local_size, world_size, device_type, sharder)
        if pooling_factor is None:
            return ps
        return HybridParameterSharding.from_stock(ps, cold_layout=cold, pooling_factor=float(pooling_factor))

    def _sharding(param, local_size, world_size, device_type, sharder) -> ParameterSharding:
        rows, cols = param.shape
        # TorchRec's EC and FPEBC sharders: refused here, where the plan is written, not at sharding
        if sharder is not None and FREQUENCY_HYBRID not in sharder.sharding_types(device_type):
            raise ValueError(f"{call} for a {rows} x {cols} {sharder.module_type.__name__} table: its sharder "
                             f"{type(sharder).__name__} does not offer {FREQUENCY_HYBRID} on {device_type}; only "
                             "HybridEmbeddingBagCollectionSharder does, for EmbeddingBagCollection tables - give "
                             "this table a stock sharding type")
        owners = [rank] if rank is not None else list(ranks or [])
        if any(r >= world_size for r in owners):
            raise ValueError(f"{call} for a {rows} x {cols} table: rank(s) {owners} outside [0, {world_size})")
        ps = stock(param, local_size, world_size, device_type, sharder)
        ps.sharding_type = FREQUENCY_HYBRID
        if cold == row_blocks.TABLE_WISE and rows < world_size:  # stock table_wise's spec: one shard
            assert rank is not None  # checked above: cold='table_wise' needs rank=
            ps = table_wise(rank=rank, compute_kernel=compute_kernel)(param, local_size, world_size, device_type,
                                                                      sharder)
            ps.sharding_type, ps.ranks = FREQUENCY_HYBRID, list(range(world_size))
            return ps
        if cold == row_blocks.TABLE_WISE:
            assert rank is not None  # checked above: cold='table_wise' needs rank=
            slices = [row_blocks.ColumnSlice(0, cols, row_blocks.single_owner_bounds(rows, world_size, rank))]
        elif cold == row_blocks.COLUMN_WISE:  # stock column_wise's spec: one shard per slice
            cw = column_wise(ranks=list(ranks or []), compute_kernel=compute_kernel)
            ps = cw(param, local_size, world_size, device_type, sharder)
            ps.sharding_type = FREQUENCY_HYBRID
            return ps
        elif row_bounds is not None:
            try:
                bounds = row_blocks.check_bounds("?", row_bounds, rows, world_size)
            except ValueError as e:  # the generator does not know the table's name: name the call and shape
                raise ValueError(f"{call} for a {rows} x {cols} table on {world_size} ranks: "
                                 + str(e).replace("table '?': ", "")) from None
            slices = [row_blocks.ColumnSlice(0, cols, bounds)]
        elif (even := row_blocks.even_bounds(rows, world_size)) != row_blocks.stock_bounds(rows, world_size):
            # stock row_wise would leave a rank without rows (6 rows on 4 ranks), which sharding refuses
            slices = [row_blocks.ColumnSlice(0, cols, even)]
        else:
            return ps
        ps.sharding_spec = hybrid_spec(slices, [s.placement for s in ps.sharding_spec.shards])
        return ps

    return _generator


PlanLike = Union[ShardingPlan, Mapping[str, ParameterSharding]]


def planned_sharding_types(plan: PlanLike) -> Dict[str, str]:
    """Table name -> sharding type over every module of a ``ShardingPlan`` (or of one
    module's plan, ``{table: ParameterSharding}``)."""
    module_plans = list(plan.plan.values()) if isinstance(plan, ShardingPlan) else [plan]
    out: Dict[str, str] = {}
    for module_plan in module_plans:
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            out[name] = ps.sharding_type
    return out


def embedding_table_names(module: Any) -> List[str]:
    """Names of the tables of every EmbeddingBagCollection-like submodule of ``module``."""
    names: Dict[str, None] = {}
    for _, m in module.named_modules():
        configs = getattr(m, "embedding_bag_configs", None)
        if callable(configs):
            names.update((c.name, None) for c in configs())
    return list(names)


def check_hot_ids(hot_ids: Optional[Mapping[str, Any]], plan: Optional[PlanLike] = None,
                  tables: Optional[Iterable[str]] = None) -> List[str]:
    """Checks which tables user-given ``hot_ids`` name, against the model and the plan.

    - a name that is no table (of ``tables``; default: the tables of ``plan``) raises
      :class:`HotSetError` listing every such name and the known tables;
    - names of tables ``plan`` does not make ``frequency_hybrid`` give *one* ``UserWarning``
      listing them with their planned type (their hot ids are ignored).

    Returns the ignored table names. ``plan=None`` checks the names only. Only names are
    checked here; the ids themselves are checked (range, duplicates, equal on every rank)
    by ``normalize_hot_ids`` when the module is sharded.
    """
    if not hot_ids:
        return []
    types = planned_sharding_types(plan) if plan is not None else {}
    known = list(dict.fromkeys(tables)) if tables is not None else list(types)
    if tables is None and plan is None:
        raise ValueError("check_hot_ids needs the plan or the table names")
    unknown = [n for n in hot_ids if n not in set(known)]
    if unknown:
        shown = known if len(known) <= 30 else known[:30] + [f"... {len(known) - 30} more"]
        raise HotSetError(f"hot_ids name table(s) that do not exist: {unknown}; the tables are {shown}")
    if plan is None:
        return []
    ignored = [n for n in hot_ids if types.get(n) != FREQUENCY_HYBRID]
    if ignored:
        planned = ", ".join(f"{n}: {types.get(n, 'not in the plan')}" for n in ignored)
        warnings.warn(f"hot_ids are ignored for {len(ignored)} table(s) the plan does not make "
                      f"{FREQUENCY_HYBRID}: {ignored} (planned: {planned})", UserWarning, stacklevel=2)
    return ignored
