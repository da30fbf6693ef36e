"""Planner-side data: the hot-set choice of one table and the plan entry that carries it.

A ``HybridParameterSharding`` is a stock ``ParameterSharding`` plus the table's hot ids, so
a plan (pickled, broadcast by ``collective_plan``, saved to disk) reproduces the same hot
set on every rank; the sharded module reads ``parameter_sharding.hot_ids`` and prefers it
over the sharder's.
"""

from dataclasses import dataclass, field, fields
from typing import Any, List, Optional

import torch
from torchrec.distributed.types import ParameterSharding


@dataclass(eq=False)
class HybridParameterSharding(ParameterSharding):
    """``ParameterSharding`` of a ``frequency_hybrid`` table.

    hot_ids: sorted distinct int64 row ids replicated on every rank (None: the sharder's).
    hot_rows: number of hot rows the planner priced (== hot_ids.numel() when ids are known).
    cold_layout: where the cold rows live (row_blocks.py).
    pooling_factor: ids per sample of the table's bags, the largest over its features of its
        sharding option's ``input_lengths`` (the constraints', else measured from the
        statistics, else TorchRec's default 1.0); None in a hand-written plan that gives none.
        A rank holding most of a multi-hot table's cold rows looks it up in a TBE call of its
        own (lookup.py: ``own_lane_pays``).
    """

    hot_ids: Optional[torch.Tensor] = None
    hot_rows: int = 0
    cold_layout: str = "row_wise"
    pooling_factor: Optional[float] = None

    @classmethod
    def from_stock(cls, ps: ParameterSharding, **changes: Any) -> "HybridParameterSharding":
        """A stock entry's fields (those of ``ParameterSharding``) with ``changes`` applied."""
        base = {f.name: getattr(ps, f.name) for f in fields(ParameterSharding)}
        return cls(**{**base, **changes})

    def __eq__(self, other: object) -> bool:  # dataclass eq would call bool() on a tensor
        if not isinstance(other, HybridParameterSharding):
            return False
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)):
                    return False
            elif a != b:
                return False
        return True

    # unhashable (mutable), like ParameterSharding; typeshed types object.__hash__ as a method only
    __hash__ = None  # type: ignore[assignment]


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
    profile: Any = None  # the hot_set.TableProfile the choice was made on (owner loads)
    widths: List[int] = field(default_factory=list)  # column slices' widths (one: the full width)
