"""Cold-row layouts: which rank owns which rows of a frequency_hybrid table.

Every layout is a list of contiguous row blocks, one per rank in rank order, given by its
bounds ``[b_0 = 0, b_1, ..., b_W = rows]`` (rank r owns rows ``b_r .. b_{r+1}-1``): even
(:func:`even_bounds`), balanced by lookup cost (:func:`balanced_bounds`) or one owner
(:func:`single_owner_bounds`); column-wise cold tables are cut in slices (:class:`ColumnSlice`).
No block is empty when the table has at least W rows (FBGEMM's CPU TBE fails on a table of
zero rows). docs/architecture.md §3 describes the layouts and when each is used.

No other module of the package is imported here: the sharding reads layouts from this module
and the planner's cost model prices them (:func:`heavy_tables`), from the same rules."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

import torch
from torchrec.distributed.types import ParameterSharding

ROW_WISE = "row_wise"
TABLE_WISE = "table_wise"
COLUMN_WISE = "column_wise"
COLD_LAYOUTS = (ROW_WISE, TABLE_WISE, COLUMN_WISE)

# A heavy table whose bags hold at least this many ids on average (the plan's pooling factor)
# gets a TBE call of its own instead of virtual features (lookup.own_lane_pays): FBGEMM's CPU
# backward takes its vectorised path (fbgemm's SpMDM + rowwise-AdaGrad kernels) only for
# EXACT_ROWWISE_ADAGRAD on a table looked up by one feature, and a shared table's scalar path
# cost the owner of the DLRMv2 multi-hot tables' heaviest bags ~2x its backward; a second call
# and the concatenation of the two outputs cost more than that path with one id per bag
# (docs/architecture.md §2, step 3).
MULTI_HOT_POOLING = 2.0


class ColumnSlice(NamedTuple):
    """Columns ``offset .. offset + width - 1`` of a table, in row blocks ``bounds`` (one per rank)."""

    offset: int
    width: int
    bounds: List[int]


def column_widths(cols: int, slices: int) -> List[int]:
    """Column slices as stock column_wise cuts them: ``ceil(cols / k)`` columns rounded up to a
    multiple of 4 (FBGEMM's TBE needs it) per slice, the last one narrower."""
    width = -(-cols // slices)
    width += -width % 4
    if slices < 1 or cols % 4 or width * (slices - 1) >= cols:
        raise ValueError(f"cannot cut {cols} columns in {slices} slices of a multiple of 4 columns")
    return [min(width, cols - s * width) for s in range(slices)]


def stock_bounds(rows: int, world: int) -> List[int]:
    """TorchRec's row-wise blocks: ``ceil(rows / W)`` rows per rank, the last ones shorter or empty."""
    block = (rows + world - 1) // world
    return [min(r * block, rows) for r in range(world + 1)]


def even_bounds(rows: int, world: int) -> List[int]:
    """Even row blocks: TorchRec's (:func:`stock_bounds`) where they give every rank a row or the
    table has fewer rows than ranks; else (6 rows on 4 ranks: 2, 2, 2, 0) ``rows // W`` or one more
    per rank (1, 2, 1, 2), so that no rank of a table of at least W rows is left without one."""
    b = stock_bounds(rows, world)
    if rows >= world and any(y == x for x, y in zip(b, b[1:])):
        b = [r * rows // world for r in range(world + 1)]
    return b


def single_owner_bounds(rows: int, world: int, rank: int) -> List[int]:
    """The table-wise cold layout: every row on ``rank`` but one on each other rank (see the
    module docstring; a table of fewer than W rows goes wholly to ``rank``)."""
    if not 0 <= rank < world:
        raise ValueError(f"owner rank {rank} is outside [0, {world})")
    if rows < world:
        return [0] * (rank + 1) + [rows] * (world - rank)
    return list(range(rank + 1)) + [rows - (world - j) for j in range(rank + 1, world + 1)]


def balanced_bounds(row_cost: torch.Tensor, world: int) -> List[int]:
    """Contiguous blocks of (nearly) equal summed ``row_cost`` (``[rows]``, >= 0, by row id).

    Block r ends at the first row where the running cost reaches ``(r + 1) / W`` of the
    total, so no block exceeds ``1/W`` of the total by more than one row's cost. Rows of
    zero cost (never seen) count as a small epsilon so that memory spreads too. Every block
    keeps at least one row when ``rows >= W`` (module docstring).
    """
    rows = int(row_cost.numel())
    cost = row_cost.to(torch.float64).clamp(min=0)
    total = float(cost.sum())
    eps = (total / rows * 1e-3) if total > 0 else 1.0
    cum = torch.cumsum(cost + eps, 0)
    targets = cum[-1] * torch.arange(1, world, dtype=torch.float64) / world
    inner = torch.searchsorted(cum, targets).add_(1).clamp_(max=rows).tolist()
    bounds = [0] + inner + [rows]
    if rows >= world:  # at least one row per block (W - 1 boundaries: a set-up time loop)
        for r in range(1, world):
            bounds[r] = min(max(bounds[r], bounds[r - 1] + 1), rows - (world - r))
    return bounds


def heavy_tables(world: int, local_rows: List[int], rows: List[int]) -> List[bool]:
    """Which tables this owner holds most cold rows of (so gets about the global batch of
    their bags): more than 1.5 times an even share."""
    return [world > 1 and lr * world > 1.5 * max(r, 1) for lr, r in zip(local_rows, rows)]


def check_bounds(name: str, bounds: Sequence[int], rows: int, world: int) -> List[int]:
    """``bounds`` as a list, or ValueError naming the table and what is wrong."""
    b = [int(x) for x in bounds]
    if len(b) != world + 1:
        raise ValueError(f"table '{name}': row bounds need {world + 1} entries (one block per rank), got {len(b)}")
    if b[0] != 0 or b[-1] != rows:
        raise ValueError(f"table '{name}': row bounds must run from 0 to {rows}, got {b[0]} .. {b[-1]}")
    if any(y < x for x, y in zip(b, b[1:])):
        raise ValueError(f"table '{name}': row bounds must not decrease, got {b}")
    empty = [r for r in range(world) if b[r + 1] == b[r]]
    if empty:
        raise ValueError(f"table '{name}': row bounds {b} leave ranks {empty} without rows; FBGEMM's CPU TBE "
                         "cannot hold an empty table (give every rank at least one row; a table with fewer rows "
                         "than ranks: frequency_hybrid(cold='table_wise', rank=k), one shard of the whole table "
                         "on rank k, as the planner lays it out, or a stock type)")
    return b


def is_row_layout(shards: Sequence[Any], world: int) -> bool:
    """Whether a hybrid spec's ``shards`` are row blocks (one full-width block per rank), not
    column slices: every shard starts at column 0, and - with several ranks - there is more
    than one shard (a lone shard of the whole table is a slice of full width on its owner)."""
    return all(s.shard_offsets[1] == 0 for s in shards) and (len(shards) != 1 or world == 1)


def slices_of(name: str, ps: ParameterSharding, rows: int, cols: int, world: int) -> List[ColumnSlice]:
    """The column slices and row bounds a plan entry's sharding spec encodes.

    Either one contiguous full-width row block per rank in rank order (row-wise / table-wise
    cold: one slice), or stock column_wise's spec: per column slice in column order one shard
    of every row on its owner (column-wise cold; the slice's other blocks are empty). A lone
    shard of the whole table, as stock table_wise writes it, is one slice of full width: how a
    table with fewer rows than ranks is laid out table-wise cold (``sharding_plan.frequency_hybrid``). Raises
    ValueError naming the table and the first shard that does not fit.
    """
    shards = list(getattr(ps.sharding_spec, "shards", None) or [])
    if is_row_layout(shards, world):
        return [ColumnSlice(0, cols, _row_bounds(name, shards, rows, cols, world))]
    out: List[ColumnSlice] = []
    for i, s in enumerate(shards):
        col, placement = sum(x.width for x in out), str(s.placement)
        off, size = list(s.shard_offsets), list(s.shard_sizes)
        owner = int(placement.split("/")[0].split(":")[1]) if placement.startswith("rank:") else -1
        if off != [0, col] or size[0] != rows or size[1] <= 0 or size[1] % 4 or not 0 <= owner < world:
            raise ValueError(f"table '{name}': shard {i} ({placement}, offsets {off}, sizes {size}) is neither one "
                             f"row block per rank nor the column slice of every row at column {col} on one of "
                             f"the {world} ranks (slices of a multiple of 4 columns)")
        out.append(ColumnSlice(col, size[1], [0] * (owner + 1) + [rows] * (world - owner)))
    if sum(x.width for x in out) != cols:
        raise ValueError(f"table '{name}': column slices of widths {[x.width for x in out]} do not cover its "
                         f"{cols} columns")
    width_on: dict = {}  # a rank's slices of one table share one TBE, which needs them of one width
    for x in out:
        if width_on.setdefault(x.bounds.index(rows), x.width) != x.width:
            raise ValueError(f"table '{name}': rank {x.bounds.index(rows) - 1} holds column slices of widths "
                             f"{width_on[x.bounds.index(rows)]} and {x.width}; slices on one rank need one width")
    return out


def _row_bounds(name: str, shards: list, rows: int, cols: int, world: int) -> List[int]:
    """The bounds of one full-width row block per rank (``shards`` in rank order)."""
    if len(shards) != world:
        raise ValueError(f"table '{name}': a frequency_hybrid plan needs one row block per rank "
                         f"({world}), got {len(shards)} shards")
    bounds = [0]
    for r, s in enumerate(shards):
        off, size = list(s.shard_offsets), list(s.shard_sizes)
        placement = str(s.placement)
        if off[1] != 0 or (size[0] > 0 and size[1] != cols) or off[0] != bounds[-1] or \
                not placement.startswith(f"rank:{r}/"):
            raise ValueError(f"table '{name}': shard {r} ({placement}, offsets {off}, sizes {size}) is not "
                             f"the full-width row block after row {bounds[-1]} on rank {r}")
        bounds.append(off[0] + size[0])
    return check_bounds(name, bounds, rows, world)


def owners(ids: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Owner rank of each row id (``bounds``: int64 ``[W + 1]``); empty blocks own nothing.

    Among blocks starting at or before an id, the last one is the non-empty block holding it
    (an empty block starts where the next block does).
    """
    return torch.searchsorted(bounds[:-1], ids, right=True) - 1


def bucket_ids(rows: torch.Tensor, buckets, world: int) -> torch.Tensor:
    """The ids :func:`bucketize` sends to bucket ``buckets`` (an owner rank, or W: stays
    here) as row ``rows``: ``row * (W + 1) + bucket``. One encoding routes any row layout
    (empty blocks, uneven blocks, single owners) by its owner."""
    return rows * (world + 1) + buckets


def bucketize(lengths: torch.Tensor, ids: torch.Tensor, world: int, weights: Optional[torch.Tensor] = None):
    """FBGEMM's cyclic bucketization into W + 1 buckets, which decodes :func:`bucket_ids`:
    id ``i`` goes to bucket ``i % (W + 1)`` as row ``i // (W + 1)``. Returns the lengths per
    (bucket, bag) ``[(W + 1) * bags]``, the rows and the weights, bucket after bucket, each
    bucket's in the bags' order. (The block bucketization with block sizes 0 gives the same,
    about a fifth slower; the cyclic one takes lengths of the ids' dtype.)"""
    lengths, rows, weights, _ = torch.ops.fbgemm.bucketize_sparse_features(
        lengths.to(ids.dtype), ids, False, world + 1, weights)
    return lengths.view(-1), rows, weights
