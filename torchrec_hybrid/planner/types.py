"""Planner-side data: the hot-set choice of one table (its plan entry, ``HybridParameterSharding``,
lives in ``torchrec_hybrid.types``, where the sharding reads it; plans pickled before it moved
name it here)."""

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from torchrec_hybrid.types import HybridParameterSharding  # noqa: F401


@dataclass
class HotSetChoice:
    """What the planner decided for one table's hot set, kept on its sharding option.

    hot_ids: the H most frequent rows (sorted), or None when no ids are known (no
        statistics and no sharder hot ids): the sharder's ids are then used at shard time.
    coverage: estimated share of the table's lookups served by the hot rows.
    bytes_per_step: cost-model bytes per rank per step at this H (all collectives).
    comm_bytes: the same split by collective ("lengths", "cold_ids", "partials", "hot_sync").
    step_cost: bytes / bandwidth of each collective (what H minimises).
    best_stock_*: the cheapest allowed stock type for the table by the same cost model.
    source: "stats", "sharder" or "uniform" (where coverage came from).
    cold_layout: where the cold rows live (row_blocks.py); profile: what H was sized on;
        widths: its column slices' widths (column-wise cold; else the full width).
    forced: frequency_hybrid was the only type the constraints allowed.
    """

    table: str
    hot_rows: int
    coverage: float
    hot_ids: Optional[torch.Tensor]
    bytes_per_step: float
    comm_bytes: dict
    step_cost: float = 0.0
    best_stock_type: Optional[str] = None
    best_stock_bytes: Optional[float] = None
    best_stock_cost: Optional[float] = None
    source: str = "stats"
    forced: bool = False
    cold_layout: str = "row_wise"  # row_blocks.ROW_WISE, TABLE_WISE or COLUMN_WISE
    profile: Any = None  # the cost_model.TableProfile the choice was made on (owner loads)
    widths: List[int] = field(default_factory=list)  # column slices' widths (one: the full width)
