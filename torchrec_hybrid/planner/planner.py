"""``HybridEmbeddingShardingPlanner``: TorchRec's planner, aware of ``frequency_hybrid``.

Same constructor arguments and methods as ``EmbeddingShardingPlanner`` (``plan``,
``collective_plan``), plus frequency statistics and hot-set options. Per table the search
space holds the stock options and, where it pays (see ``enumerator.py``), one
``frequency_hybrid`` option whose hot set H minimises the estimated step cost within the
per-rank hot-row budget. The stock proposers/partitioner then choose among them by the
estimated perf. Hybrid tables come out of ``plan`` as :class:`HybridParameterSharding` with
their hot ids, so the plan alone reproduces the sharding on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.planner.constants import POOLING_FACTOR
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan

from torchrec_hybrid.planner.enumerator import DEFAULT_MAX_HOT_ROWS, HybridEnumerator
from torchrec_hybrid.planner.stats import HybridEmbeddingStats
from torchrec_hybrid.planner.types import HybridParameterSharding
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)


def _is_frequency_stats(obj: Any) -> bool:
    return hasattr(obj, "top_counts") and hasattr(obj, "lookups") and hasattr(obj, "table_names")


def constraints_with_measured_pooling(constraints: Optional[Dict[str, ParameterConstraints]],
                                      frequency_stats: Any) -> Optional[Dict[str, ParameterConstraints]]:
    """Pooling factors per feature from the statistics where the constraints leave the default.

    All estimators (stock and hybrid) then price the same, measured, ids per bag.
    """
    if frequency_stats is None or not frequency_stats.num_samples:
        return constraints
    out = dict(constraints or {})
    for cfg in frequency_stats.tables:
        feats = max(1, len(cfg.feature_names))
        mean = frequency_stats.lookups(cfg.name) / (frequency_stats.num_samples * feats)
        c = out.get(cfg.name)
        if c is None:
            out[cfg.name] = ParameterConstraints(pooling_factors=[mean] * feats)
        elif list(c.pooling_factors) == [POOLING_FACTOR]:
            out[cfg.name] = dataclasses.replace(c, pooling_factors=[mean] * feats)
    return out


class HybridEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """``EmbeddingShardingPlanner`` that also plans ``frequency_hybrid`` tables.

    Args: those of ``EmbeddingShardingPlanner``, and
        stats: as in TorchRec (``Stats`` loggers), or a ``FrequencyStats`` (then taken as
            ``frequency_stats`` and the default :class:`HybridEmbeddingStats` logs).
        frequency_stats: per-row lookup counts of the tables (``torchrec_hybrid.stats``).
            Without them a table can only go hybrid when forced by constraints, with the
            sharder's hot ids (or none).
        hot_budget_bytes: per-rank memory for all hot replicas incl. optimizer state
            (default: a quarter of a rank's memory).
        max_hot_rows: cap on hot rows per table. min_saving: relative step-cost saving over
            the cheapest stock type needed before hybrid is offered for a table.
    """

    def __init__(self, topology=None, batch_size=None, enumerator=None, storage_reservation=None,
                 proposer=None, partitioner=None, performance_model=None, stats=None, constraints=None,
                 debug: bool = True, callbacks=None, timeout_seconds=None, plan_loader=None, *,
                 frequency_stats: Any = None, hot_budget_bytes: Optional[int] = None,
                 max_hot_rows: int = DEFAULT_MAX_HOT_ROWS, min_saving: float = 0.05) -> None:
        if stats is not None and _is_frequency_stats(stats):
            frequency_stats, stats = stats, None
        constraints = constraints_with_measured_pooling(constraints, frequency_stats)
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         storage_reservation=storage_reservation, proposer=proposer, partitioner=partitioner,
                         performance_model=performance_model,
                         stats=stats if stats is not None else [HybridEmbeddingStats()],
                         constraints=constraints, debug=debug, callbacks=callbacks,
                         timeout_seconds=timeout_seconds, plan_loader=plan_loader)
        if enumerator is None:
            self._enumerator = HybridEnumerator(
                self._topology, self._batch_size, constraints, frequency_stats=frequency_stats,
                hot_budget_bytes=hot_budget_bytes, max_hot_rows=max_hot_rows, min_saving=min_saving)
        self.frequency_stats = frequency_stats

    def plan(self, module, sharders) -> ShardingPlan:
        plan = super().plan(module, sharders)
        return self._attach_hot_ids(plan)

    def _attach_hot_ids(self, plan: ShardingPlan) -> ShardingPlan:
        """Replace hybrid tables' ``ParameterSharding`` by ``HybridParameterSharding`` (+ hot ids)."""
        for so in self._best_plan or []:
            if so.sharding_type != FREQUENCY_HYBRID:
                continue
            module_plan = plan.plan[so.path]
            ps = module_plan[so.name]
            choice = getattr(so, "hybrid_choice", None)
            ids = choice.hot_ids if choice is not None else None
            if ids is None:
                ids = torch.empty(0, dtype=torch.int64)
            base = {f.name: getattr(ps, f.name) for f in dataclasses.fields(ps)}
            module_plan[so.name] = HybridParameterSharding(**base, hot_ids=ids.clone(),
                                                           hot_rows=int(ids.numel()))
            logger.info("table %s: frequency_hybrid, %d hot rows (coverage %.3f, %s)", so.name,
                        ids.numel(), choice.coverage if choice else 0.0, choice.source if choice else "?")
        return plan

    def hybrid_choices(self) -> Dict[str, Any]:
        """The hot-set choice of every table the last ``plan`` considered for hybrid."""
        return dict(getattr(self._enumerator, "choices", {}))

    def planned_options(self) -> List[Any]:
        """The sharding options of the last plan (with ``hybrid_choice`` on hybrid ones)."""
        return list(self._best_plan or [])
