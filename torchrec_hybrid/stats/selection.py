"""Choosing the hot (replicated) rows of each table from `FrequencyStats`.

Every rule is deterministic: rows are ranked by count (descending), ties broken by the
smaller id, so every rank that holds the same statistics derives the same hot ids. Rows
never looked up are never selected. Each rule returns ``{table_name: int64 tensor of
sorted distinct ids}`` with an entry (possibly empty) for every table.

Rules:
- ``rows_per_table``: the k most frequent rows per table (an int, or a dict per table;
  tables missing from the dict get none).
- ``memory_budget_bytes``: hot rows cost memory on every rank, so spend a per-rank budget
  greedily on the rows that save the most lookups per byte across all tables; a row that
  no longer fits is skipped and cheaper rows further down are still considered.
- ``coverage``: per table, the smallest hot set whose share of that table's lookups is at
  least the target.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_hybrid.stats.frequency import FrequencyStats

logger = logging.getLogger(__name__)

HotIds = Dict[str, torch.Tensor]
BytesPerRow = Union[Callable[[EmbeddingBagConfig], int], Mapping[str, int], None]

# Optimizer state per row, in bytes, as a function of embedding_dim (fp32 state).
OPTIMIZER_STATE_BYTES: Dict[str, Callable[[int], int]] = {
    "sgd": lambda dim: 0,
    "rowwise_adagrad": lambda dim: 4,
    "adagrad": lambda dim: 4 * dim,
    "adam": lambda dim: 8 * dim,
}


def default_bytes_per_row(cfg: EmbeddingBagConfig, optimizer: Optional[str] = None) -> int:
    """fp32 weights (embedding_dim * 4) plus the optimizer's per-row state, if named."""
    extra = 0
    if optimizer is not None:
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"unknown optimizer {optimizer!r}; known: {list(OPTIMIZER_STATE_BYTES)}")
        extra = OPTIMIZER_STATE_BYTES[optimizer](cfg.embedding_dim)
    return cfg.embedding_dim * 4 + extra


def _per_table(value, name: str, default):
    return value.get(name, default) if isinstance(value, Mapping) else value


def _check_names(value, stats: FrequencyStats, what: str) -> None:
    """A per-table mapping naming a table the statistics lack (a misspelt name would select nothing) raises."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(stats.table_names))
        if unknown:
            raise ValueError(f"{what} names table(s) {unknown} the statistics do not count; they count "
                             f"{stats.table_names}")


def _count(value, name: str) -> int:
    """A per-table row count: an int (not a bool, not a fraction that would be cut short)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if not (isinstance(value, float) and value.is_integer()):
            raise ValueError(f"rows_per_table for {name!r} must be an int, got {value!r}")
    return int(value)


def _sorted_ids(ids: torch.Tensor) -> torch.Tensor:
    return torch.sort(ids.to(torch.int64)).values


def _by_rows(stats: FrequencyStats, rows: Union[int, Mapping[str, int]]) -> HotIds:
    _check_names(rows, stats, "rows_per_table")
    out = {}
    for name in stats.table_names:
        k = _count(_per_table(rows, name, 0), name)
        if k < 0:
            raise ValueError(f"rows_per_table for {name!r} must be >= 0, got {k}")
        out[name] = _sorted_ids(stats.top_counts(name, k)[0])
    return out


def _by_coverage(stats: FrequencyStats, target: Union[float, Mapping[str, float]]) -> HotIds:
    _check_names(target, stats, "coverage")
    out = {}
    for name in stats.table_names:
        t = float(_per_table(target, name, 0.0))
        if not 0.0 <= t <= 1.0:
            raise ValueError(f"coverage for {name!r} must be in [0, 1], got {t}")
        ids, counts = stats.top_counts(name)
        total = stats.lookups(name)
        if t == 0.0 or total == 0:
            out[name] = ids[:0]
            continue
        covered = torch.cumsum(counts, 0).to(torch.float64)
        # first prefix reaching t; the tiny slack keeps e.g. 0.8 * 25 == 20 exact
        n = int(torch.searchsorted(covered, t * total * (1 - 1e-12))) + 1
        if n > ids.numel():
            logger.warning("table %s: its %d known rows cover less than %.3f of lookups",
                           name, ids.numel(), t)
        out[name] = _sorted_ids(ids[:n])
    return out


def _by_budget(stats: FrequencyStats, budget: int, bytes_per_row: BytesPerRow,
               optimizer: Optional[str]) -> HotIds:
    names = stats.table_names
    _check_names(bytes_per_row, stats, "bytes_per_row")
    sizes: List[int] = []
    for name in names:
        cfg = stats.config(name)
        if bytes_per_row is None:
            b = default_bytes_per_row(cfg, optimizer)
        elif isinstance(bytes_per_row, Mapping):
            b = bytes_per_row[name]
        else:
            b = bytes_per_row(cfg)
        if b <= 0:
            raise ValueError(f"bytes per row of {name!r} must be > 0, got {b}")
        sizes.append(int(b))
    tops = [stats.top_counts(n) for n in names]
    ids = torch.cat([t[0].cpu() for t in tops])
    counts = torch.cat([t[1].cpu() for t in tops])
    table = torch.cat([torch.full((t[0].numel(),), i, dtype=torch.int64) for i, t in enumerate(tops)])
    size = torch.tensor(sizes, dtype=torch.int64)[table]
    # Blocks are in table order, each by count desc / id asc, so a stable sort on value
    # breaks ties by table order, then by id.
    order = torch.sort(counts.to(torch.float64) / size, descending=True, stable=True).indices
    ids, table, size = ids[order], table[order], size[order]
    chosen = torch.zeros(ids.numel(), dtype=torch.bool)
    active = torch.ones(ids.numel(), dtype=torch.bool)
    remaining = int(budget)
    while bool(active.any()):
        pos = torch.nonzero(active).view(-1)
        fits = torch.cumsum(size[pos], 0) <= remaining  # a prefix: sizes are positive
        n_fit = int(fits.sum())
        chosen[pos[:n_fit]] = True
        remaining -= int(size[pos[:n_fit]].sum())
        if n_fit == pos.numel():
            break
        # The first row that did not fit has size s > remaining: rows of size >= s will
        # never fit again; smaller rows further down are still tried, in order.
        active[pos[:n_fit]] = False
        active &= size < size[pos[n_fit]]
    return {name: _sorted_ids(ids[chosen & (table == i)]) for i, name in enumerate(names)}


def select_hot_ids(
    stats: FrequencyStats,
    rows_per_table: Union[int, Mapping[str, int], None] = None,
    *,
    memory_budget_bytes: Optional[int] = None,
    bytes_per_row: BytesPerRow = None,
    optimizer: Optional[str] = None,
    coverage: Union[float, Mapping[str, float], None] = None,
) -> HotIds:
    """Hot ids per table under exactly one rule (see the module docstring).

    ``bytes_per_row`` (a function of the table config, or a dict per table name) and
    ``optimizer`` (adds its per-row state to the default embedding_dim * 4) only apply to
    ``memory_budget_bytes``.
    """
    given = [x is not None for x in (rows_per_table, memory_budget_bytes, coverage)]
    if sum(given) != 1:
        raise ValueError("give exactly one of rows_per_table, memory_budget_bytes, coverage")
    if rows_per_table is not None:
        return _by_rows(stats, rows_per_table)
    if coverage is not None:
        return _by_coverage(stats, coverage)
    assert memory_budget_bytes is not None  # exactly one rule was given
    if memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
    return _by_budget(stats, memory_budget_bytes, bytes_per_row, optimizer)


def coverage_curve(stats: FrequencyStats, table: str, sizes: Iterable[int]) -> torch.Tensor:
    """Fraction of `table`'s lookups covered by its s most frequent rows, for each s."""
    sizes = [int(s) for s in sizes]
    _, counts = stats.top_counts(table)
    total = stats.lookups(table)
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts.cpu(), 0)])
    if total == 0:
        return torch.zeros(len(sizes), dtype=torch.float64)
    idx = torch.tensor([min(max(s, 0), counts.numel()) for s in sizes], dtype=torch.int64)
    return (cum[idx].to(torch.float64) / total).clamp_(max=1.0)


@dataclass(frozen=True)
class HotSetRule:
    """One hot-set rule, to hand a sharder statistics + a rule instead of explicit ids.

    Set exactly one of ``rows_per_table``, ``memory_budget_bytes`` or ``coverage``;
    ``bytes_per_row`` / ``optimizer`` refine ``memory_budget_bytes``.
    """

    rows_per_table: Union[int, Mapping[str, int], None] = None
    memory_budget_bytes: Optional[int] = None
    coverage: Union[float, Mapping[str, float], None] = None
    bytes_per_row: BytesPerRow = None
    optimizer: Optional[str] = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.rows_per_table, self.memory_budget_bytes, self.coverage)]
        if sum(given) != 1:
            raise ValueError("HotSetRule needs exactly one of rows_per_table, "
                             "memory_budget_bytes, coverage")

    def select(self, stats: FrequencyStats) -> HotIds:
        return select_hot_ids(
            stats, self.rows_per_table, memory_budget_bytes=self.memory_budget_bytes,
            bytes_per_row=self.bytes_per_row, optimizer=self.optimizer, coverage=self.coverage,
        )


def resolve_hot_ids(stats: FrequencyStats, rule: HotSetRule) -> HotIds:
    """Hot ids per table for `rule` (the hook a sharder calls with stats + a rule)."""
    return rule.select(stats)
