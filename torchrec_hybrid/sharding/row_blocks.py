"""Cold-row layouts: which rank owns which rows of a frequency_hybrid table.

Every layout is a list of contiguous row blocks, one per rank in rank order, given by its
bounds ``[b_0 = 0, b_1, ..., b_W = rows]`` (rank r owns rows ``b_r .. b_{r+1}-1``; a block
may be empty). The one encoding covers every cold layout we offer:

- ``row_wise``: stock even blocks of ``ceil(rows / W)`` rows (:func:`even_bounds`);
- ``row_wise`` balanced: uneven blocks of equal lookup cost, chosen from the statistics
  (:func:`balanced_bounds`), so frequency-sorted vocabularies do not pile the hottest cold
  rows onto the first owner;
- ``table_wise``: one block holding every row on one rank (:func:`single_owner_bounds`): a
  multi-hot bag then returns one partial sum, not one per owner it touches.

No block is empty when the table has at least W rows: FBGEMM's CPU TBE fails on a table of
zero rows (EXACT_ROWWISE_ADAGRAD when it is the last table of a TBE, any optimizer when every
table is), so the table-wise layout leaves one row on each other rank (rows ``0..k-1`` and
the last ``W-1-k``: with frequency-sorted ids the first are hot, the last nearly never seen).

A layout is written into the plan as a stock row-wise ``EnumerableShardingSpec`` with one
(possibly empty) shard per rank, so state_dict, DCP and the fused optimizer see one logical
table whatever the layout, and checkpoints load into every stock plan and back.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torchrec.distributed.types import ParameterSharding

ROW_WISE = "row_wise"
TABLE_WISE = "table_wise"
COLD_LAYOUTS = (ROW_WISE, TABLE_WISE)


def even_bounds(rows: int, world: int) -> List[int]:
    """Stock row-wise blocks: ``ceil(rows / W)`` rows per rank, the last ones shorter or empty."""
    block = (rows + world - 1) // world
    return [min(r * block, rows) for r in range(world + 1)]


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


def check_bounds(name: str, bounds: Sequence[int], rows: int, world: int) -> List[int]:
    """``bounds`` as a list, or ValueError naming the table and what is wrong."""
    b = [int(x) for x in bounds]
    if len(b) != world + 1:
        raise ValueError(f"table '{name}': row bounds need {world + 1} entries (one block per rank), got {len(b)}")
    if b[0] != 0 or b[-1] != rows:
        raise ValueError(f"table '{name}': row bounds must run from 0 to {rows}, got {b[0]} .. {b[-1]}")
    if any(y < x for x, y in zip(b, b[1:])):
        raise ValueError(f"table '{name}': row bounds must not decrease, got {b}")
    if rows >= world and any(y == x for x, y in zip(b, b[1:])):
        raise ValueError(f"table '{name}': row bounds {b} leave a rank without rows; FBGEMM's CPU TBE cannot "
                         "hold an empty table (give every rank at least one row)")
    return b


def bounds_of(name: str, ps: ParameterSharding, rows: int, cols: int, world: int) -> List[int]:
    """The row bounds a plan entry's sharding spec encodes (one full-width shard per rank).

    Raises ValueError naming the table when the spec is not one contiguous row block per
    rank in rank order (the only shape frequency_hybrid shards take).
    """
    spec = ps.sharding_spec
    shards = getattr(spec, "shards", None)
    if shards is None or len(shards) != world:
        raise ValueError(f"table '{name}': a frequency_hybrid plan needs one row block per rank "
                         f"({world}), got {0 if shards is None else len(shards)} shards")
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
