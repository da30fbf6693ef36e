"""Hand-written plans: a ``frequency_hybrid()`` generator for ``construct_module_sharding_plan``."""

from typing import List, Optional, Sequence

from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardMetadata

from torchrec_hybrid.sharding import row_blocks
from torchrec_hybrid.types import FREQUENCY_HYBRID


def with_row_bounds(ps: ParameterSharding, bounds: Sequence[int]) -> ParameterSharding:
    """``ps`` (one row block per rank) with its blocks moved to ``bounds`` (row_blocks.py)."""
    old = ps.sharding_spec.shards
    ps.sharding_spec = EnumerableShardingSpec([
        ShardMetadata(shard_offsets=[bounds[r], 0], shard_sizes=[bounds[r + 1] - bounds[r], s.shard_sizes[1]],
                      placement=s.placement)
        for r, s in enumerate(old)
    ])
    return ps


def frequency_hybrid(compute_kernel: str = "fused", cold: str = row_blocks.ROW_WISE, rank: Optional[int] = None,
                     row_bounds: Optional[Sequence[int]] = None):
    """Like TorchRec's ``row_wise()`` / ``table_wise(rank)``, for frequency_hybrid tables.

    Hot rows are looked up locally on every rank whatever the cold layout. Cold rows:
    - ``cold="row_wise"`` (default): stock even row blocks on all ranks, or ``row_bounds``
      (``[0, b_1, ..., rows]``, one block per rank, e.g. ``row_blocks.balanced_bounds``);
    - ``cold="table_wise", rank=k``: every row on rank k (a bag's cold ids return one
      partial sum, as table_wise; best for multi-hot bags).
    """
    if cold not in row_blocks.COLD_LAYOUTS:
        raise ValueError(f"cold layout {cold!r} is not one of {list(row_blocks.COLD_LAYOUTS)}")
    if cold == row_blocks.TABLE_WISE and (rank is None or row_bounds is not None):
        raise ValueError("cold='table_wise' needs rank=<owner> and no row_bounds")
    if cold == row_blocks.ROW_WISE and rank is not None:
        raise ValueError("rank= is for cold='table_wise'; a row-wise cold layout spans every rank")
    stock = row_wise(compute_kernel=compute_kernel)

    def _generator(param, local_size, world_size, device_type, sharder, placements: Optional[List] = None
                   ) -> ParameterSharding:
        ps = stock(param, local_size, world_size, device_type, sharder)
        ps.sharding_type = FREQUENCY_HYBRID
        rows = param.shape[0]
        if cold == row_blocks.TABLE_WISE:
            assert rank is not None  # checked above: cold='table_wise' needs rank=
            bounds = row_blocks.single_owner_bounds(rows, world_size, rank)
        elif row_bounds is not None:
            bounds = row_blocks.check_bounds("?", row_bounds, rows, world_size)
        else:
            return ps
        return with_row_bounds(ps, bounds)

    return _generator
