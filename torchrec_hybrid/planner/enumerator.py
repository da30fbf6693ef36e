"""An ``EmbeddingEnumerator`` that also offers ``frequency_hybrid`` options.

The stock enumerator raises for an unknown sharding type (``calculate_shard_sizes_and_offsets``,
``get_partition_by_type``) and its estimators either raise (storage) or misprice it (perf).
So the stock enumeration runs on sharders that hide ``frequency_hybrid`` and on constraints
without it; then one hybrid option per table is added next to the stock ones:

- shards: the stock row-wise layout (the cold part is row-wise), partitioned "uniform";
- the hot set: H from the table's lookup histogram, minimising the cost model's step cost
  within the per-rank hot-row memory budget (``hot_set.choose_hot_rows``), carried on the
  option as ``hybrid_choice`` (ids included, so the plan can carry them);
- a gate: unless the constraints allow only ``frequency_hybrid``, the option is offered only
  if its estimated step cost beats the cheapest stock type offered for the table by
  ``min_saving``. Without statistics coverage is assumed uniform, which never passes.

Estimates of hybrid options come from ``estimators.HybridPerfEstimator`` /
``HybridStorageEstimator``; stock options keep the stock (or the given) estimators.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, Shard, ShardingOption, Topology
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.types import ShardingType

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner import hot_set
from torchrec_hybrid.planner.estimators import (
    HybridPerfEstimator,
    HybridStorageEstimator,
    bandwidths,
    optimizer_name,
    traffic_of,
)
from torchrec_hybrid.planner.types import HotSetChoice
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)

_TEMPLATE = ShardingType.TABLE_WISE.value  # offered on every device; cloned for hybrid-only tables
DEFAULT_MAX_HOT_ROWS = 1 << 20
DEFAULT_HOT_BUDGET_FRACTION = 0.25


class _StockOnly:
    """A sharder as the stock enumerator may see it: frequency_hybrid hidden."""

    def __init__(self, sharder: Any) -> None:
        self._sharder = sharder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sharder, name)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = [t for t in self._sharder.sharding_types(compute_device_type) if t != FREQUENCY_HYBRID]
        return types if _TEMPLATE in types else types + [_TEMPLATE]


def _stock_constraints(constraints: Optional[Dict[str, ParameterConstraints]]
                       ) -> Optional[Dict[str, ParameterConstraints]]:
    if not constraints:
        return constraints
    out = {}
    for name, c in constraints.items():
        types = c.sharding_types
        if types and FREQUENCY_HYBRID in types:
            types = [t for t in types if t != FREQUENCY_HYBRID] or [_TEMPLATE]
            c = dataclasses.replace(c, sharding_types=types)
        out[name] = c
    return out


def _stock_step_cost(so: ShardingOption, tr: cm.TableTraffic, bw: Dict[str, float]
                     ) -> Optional[Tuple[float, float]]:
    """(bytes / bandwidth, bytes) of a stock option per the cost model; None if not modelled."""
    st = so.sharding_type
    if st == ShardingType.TABLE_WISE.value:
        b, w = cm.stock_bytes(st, tr), bw["a2a"]
    elif st == ShardingType.COLUMN_WISE.value:
        b, w = cm.stock_bytes(st, tr, num_column_shards=len(so.shards)), bw["a2a"]
    elif st in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
        b, w = cm.stock_bytes(ShardingType.ROW_WISE.value, tr), bw["reduce_scatter"]
    elif st == ShardingType.DATA_PARALLEL.value:
        b, w = cm.stock_bytes(st, tr), bw["allreduce"]
    else:
        return None
    return b / w, b


class HybridEnumerator(EmbeddingEnumerator):
    """``EmbeddingEnumerator`` + one ``frequency_hybrid`` option per eligible table.

    Args (beyond the stock ones):
        frequency_stats: a ``FrequencyStats`` of the tables (per-row lookup counts).
        hot_budget_bytes: per-rank memory for all hot replicas (weights + optimizer state);
            default ``DEFAULT_HOT_BUDGET_FRACTION`` of a rank's memory.
        max_hot_rows: cap on H per table (bounds the curves evaluated).
        min_saving: relative step-cost saving over the best stock type needed to offer hybrid.
    """

    def __init__(self, topology: Topology, batch_size: int,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 estimator=None, use_exact_enumerate_order: Optional[bool] = False,
                 frequency_stats: Any = None, hot_budget_bytes: Optional[int] = None,
                 max_hot_rows: int = DEFAULT_MAX_HOT_ROWS, min_saving: float = 0.05) -> None:
        super().__init__(topology, batch_size, _stock_constraints(constraints), estimator,
                         use_exact_enumerate_order)
        self._topology = topology
        self._all_constraints = constraints or {}
        self._frequency_stats = frequency_stats
        if hot_budget_bytes is None:
            dev = topology.devices[0].storage
            cap = dev.hbm if topology.compute_device in ("cuda", "mtia") else dev.ddr
            hot_budget_bytes = int(cap * DEFAULT_HOT_BUDGET_FRACTION)
        self._hot_budget = hot_budget_bytes
        self._max_hot_rows = max_hot_rows
        self._min_saving = min_saving
        self._hybrid_estimators = [HybridPerfEstimator(topology, constraints),
                                   HybridStorageEstimator(topology, constraints)]
        self.choices: Dict[str, HotSetChoice] = {}

    # -- constraints -------------------------------------------------------------------------
    def _allowed(self, name: str, sharding_type: str) -> bool:
        c = self._all_constraints.get(name)
        return not (c and c.sharding_types) or sharding_type in c.sharding_types

    def _forced(self, name: str) -> bool:
        c = self._all_constraints.get(name)
        return bool(c and c.sharding_types and set(c.sharding_types) == {FREQUENCY_HYBRID})

    # -- enumeration -------------------------------------------------------------------------
    def enumerate(self, module, sharders) -> List[ShardingOption]:
        stock = super().enumerate(module, [_StockOnly(s) for s in sharders])
        by_type = {s.module_type: s for s in sharders}
        by_table: Dict[Tuple[str, str], List[ShardingOption]] = {}
        for so in stock:
            by_table.setdefault((so.path, so.name), []).append(so)

        candidates: Dict[str, Tuple[ShardingOption, hot_set.TableProfile]] = {}
        fixed: Dict[str, int] = {}
        dev = self._topology.compute_device
        for (_, name), opts in by_table.items():
            sharder = by_type.get(type(opts[0].module[1]))
            if sharder is None or FREQUENCY_HYBRID not in sharder.sharding_types(dev):
                continue
            if not self._allowed(name, FREQUENCY_HYBRID):
                continue
            profile, n_fixed = self._profile(opts[0], sharder)
            candidates[name] = (opts[0], profile)
            if n_fixed is not None:
                fixed[name] = n_fixed

        bw = bandwidths(self._topology)
        hot_rows = hot_set.choose_hot_rows({n: p for n, (_, p) in candidates.items()}, self._hot_budget,
                                           bw["a2a"], bw["a2a"], fixed)
        out = [so for so in stock if self._allowed(so.name, so.sharding_type)]
        hybrid: List[ShardingOption] = []
        self.choices = {}
        for name, (template, profile) in candidates.items():
            choice = self._choice(name, profile, hot_rows[name], by_table[(template.path, name)], bw)
            self.choices[name] = choice
            if not choice.forced and choice.best_stock_cost is not None and (
                    choice.step_cost > (1.0 - self._min_saving) * choice.best_stock_cost):
                logger.info("table %s: frequency_hybrid not offered (H=%d, %.0f B/step vs %s %.0f B/step)",
                            name, choice.hot_rows, choice.bytes_per_step, choice.best_stock_type,
                            choice.best_stock_bytes)
                continue
            sharder = by_type[type(template.module[1])]
            for kernel in sharder.compute_kernels(FREQUENCY_HYBRID, dev):
                hybrid.append(self._hybrid_option(template, kernel, choice))
        self.populate_estimates(hybrid)
        missing = {n for (_, n) in by_table} - {so.name for so in out + hybrid}
        if missing:
            raise RuntimeError(f"no sharding option left for tables {sorted(missing)} after constraints")
        return out + hybrid

    def _profile(self, so: ShardingOption, sharder: Any) -> Tuple[hot_set.TableProfile, Optional[int]]:
        """The table's coverage curve: statistics, else the sharder's hot ids, else uniform."""
        w = self._topology.world_size
        tr = traffic_of(so, w)
        per_row = tr.dim * so.tensor.element_size() + cm.optimizer_state_bytes_per_row(
            optimizer_name(self._sharder_data_map, so), tr.dim)
        cap = min(self._max_hot_rows, tr.rows)
        st = self._frequency_stats
        if st is not None and so.name in getattr(st, "table_names", []):
            return hot_set.profile_from_stats(st, so.name, tr, per_row, cap), None
        given = (getattr(sharder, "hot_ids", None) or {}).get(so.name)
        if given is not None and torch.as_tensor(given).numel() > 0:
            ids = torch.as_tensor(given).to(torch.int64)
            return hot_set.profile_uniform(tr, per_row, cap, ids, source="sharder"), ids.numel()
        return hot_set.profile_uniform(tr, per_row, 0), None  # no ids known: no hot rows

    def _choice(self, name: str, p: hot_set.TableProfile, h: int, stock: List[ShardingOption],
                bw: Dict[str, float]) -> HotSetChoice:
        cov = hot_set.coverage_at(p, h)
        parts = {k: float(v) for k, v in cm.hybrid_bytes(p.traffic, cov, h).items()}
        cost = (parts["lengths"] + parts["cold_ids"] + parts["partials"]) / bw["a2a"] + \
            parts["hot_sync"] / bw["a2a"]
        best = None  # (cost, type, bytes) of the cheapest allowed stock option
        for so in stock:
            if not self._allowed(name, so.sharding_type):
                continue
            c = _stock_step_cost(so, traffic_of(so, self._topology.world_size), bw)
            if c is not None and (best is None or c[0] < best[0]):
                best = (c[0], so.sharding_type, c[1])
        return HotSetChoice(
            table=name, hot_rows=h, coverage=cov, hot_ids=hot_set.hot_ids_for(p, h),
            bytes_per_step=sum(parts.values()), comm_bytes=parts, step_cost=cost,
            best_stock_type=best[1] if best else None, best_stock_bytes=best[2] if best else None,
            best_stock_cost=best[0] if best else None, source=p.source, forced=self._forced(name),
        )

    def _hybrid_option(self, template: ShardingOption, kernel: str, choice: HotSetChoice) -> ShardingOption:
        sizes, offsets = calculate_shard_sizes_and_offsets(
            template.tensor, self._topology.world_size, self._topology.local_world_size,
            ShardingType.ROW_WISE.value)
        so = copy.deepcopy(template)
        so.sharding_type, so.compute_kernel, so.partition_by = FREQUENCY_HYBRID, kernel, "uniform"
        so.shards = [Shard(size=s, offset=o) for s, o in zip(sizes, offsets)]
        so.hybrid_choice = choice
        return so

    def populate_estimates(self, sharding_options: List[ShardingOption]) -> None:
        stock = [so for so in sharding_options if so.sharding_type != FREQUENCY_HYBRID]
        hybrid = [so for so in sharding_options if so.sharding_type == FREQUENCY_HYBRID]
        if stock:
            super().populate_estimates(stock)
        for est in self._hybrid_estimators:
            if hybrid:
                est.estimate(hybrid, sharder_data_map=self._sharder_data_map)
