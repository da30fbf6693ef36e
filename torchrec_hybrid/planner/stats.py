"""The planner's stats log, with frequency_hybrid tables in it.

TorchRec's ``EmbeddingStats`` raises for a sharding type it does not know (its abbreviation
and its per-shard input/output sizes). ``HybridEmbeddingStats`` hands it the plan with its
hybrid tables labelled by their cold shard's stock type, row_wise (copies: the plan itself is
not touched), answers their per-shard sizes from the cost model (a subclass hook,
``_compat.EmbeddingStatsWithShardIO``), and appends a table of the estimated communication of
every table of the plan: type ("FH" for frequency_hybrid), hot rows, lookup coverage, bytes per
rank per step, and for hybrid tables the cheapest stock alternative by the same model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import List, Set, Tuple

import torchrec.distributed.planner.stats as tr_stats
from torchrec.distributed.planner.types import ShardingOption
from torchrec.distributed.types import ShardingPlan, ShardingType

from torchrec_hybrid import _compat
from torchrec_hybrid.planner.cost_model import option_mean_bytes
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)

ABBREVIATION = "FH"
STOCK_LABEL = ShardingType.ROW_WISE.value  # what TorchRec's stats call a hybrid table: its cold shard's type
ABBREVIATION_STOCK = "RW"
MB = 1024 * 1024


def communication_table(best_plan: List[ShardingOption], world_size: int) -> List[str]:
    """Rows of the per-table communication summary (mean bytes per rank, ``cost_model.option_mean_bytes``)."""
    header = ["Table", "Sharding", "Rows", "Hot rows", "Coverage", "Est. MB/step/rank", "Best stock (MB)"]
    rows = [header]
    total = 0.0
    for so in sorted(best_plan, key=lambda o: o.fqn):
        b = option_mean_bytes(so, world_size)
        total += b or 0.0
        ch = getattr(so, "hybrid_choice", None)
        hot, cov, best = "-", "-", "-"
        if so.sharding_type == FREQUENCY_HYBRID and ch is not None:
            hot, cov = str(ch.hot_rows), f"{ch.coverage:.3f}"
            if ch.best_stock_bytes:
                best = f"{ch.best_stock_type} {ch.best_stock_bytes / MB:.4f}"
        rows.append([
            so.fqn.lstrip("."),
            ABBREVIATION if so.sharding_type == FREQUENCY_HYBRID else so.sharding_type,
            str(so.tensor.shape[0]),
            hot,
            cov,
            "?" if b is None else f"{b / MB:.4f}",
            best,
        ])
    rows.append(["TOTAL", "", "", "", "", f"{total / MB:.4f}", ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]


def _as_stock(sharding_plan: ShardingPlan,
              best_plan: List[ShardingOption]) -> Tuple[ShardingPlan, List[ShardingOption]]:
    """Copies of the plan and its options with every frequency_hybrid entry labelled row_wise (its cold
    shard's type), for TorchRec's stats, which know only stock types."""
    plan = ShardingPlan({module: {name: dataclasses.replace(ps, sharding_type=STOCK_LABEL)
                                  if ps.sharding_type == FREQUENCY_HYBRID else ps for name, ps in params.items()}
                         for module, params in sharding_plan.plan.items()})
    options = []
    for so in best_plan:
        if so.sharding_type == FREQUENCY_HYBRID:
            so = copy.copy(so)
            so.sharding_type = STOCK_LABEL
        options.append(so)
    return plan, options


class HybridEmbeddingStats(_compat.EmbeddingStatsWithShardIO):
    """``EmbeddingStats`` that shows frequency_hybrid tables ("FH") and estimated bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._hybrid_fqns: Set[str] = set()  # the plan being logged's frequency_hybrid tables

    def log(self, sharding_plan, topology, batch_size, storage_reservation, num_proposals, num_plans,
            run_time, best_plan, constraints=None, sharders=None, enumerator=None, debug=True,
            debug_stats=None) -> None:
        self._hybrid_fqns = {so.fqn for so in best_plan if so.sharding_type == FREQUENCY_HYBRID}
        plan, options = _as_stock(sharding_plan, best_plan)
        super().log(plan, topology, batch_size, storage_reservation, num_proposals, num_plans, run_time, options,
                    constraints=constraints, sharders=sharders, enumerator=enumerator, debug=debug,
                    debug_stats=debug_stats)
        lines = ["Estimated communication per rank per step (cost model, fp32; FH = frequency_hybrid, "
                 f"counted as {ABBREVIATION_STOCK} - its cold shard - above):"]
        lines += communication_table(best_plan, topology.world_size)
        table, stock_width = _compat.stats_table(self)
        width = max([stock_width] + [len(line) + 4 for line in lines])
        boxed = [f"# {line: <{width - 3}}#" for line in lines] + ["#" * width]
        table.extend(boxed)
        for line in boxed:  # beside the stock table, through the same logger
            tr_stats.logger.info(line)

    def shard_io_sizes(self, shard, sharding_option, world_size, local_world_size, constraints):
        """A hybrid shard's input (lengths + cold ids) and output (partial sums) MB per rank."""
        if sharding_option.fqn not in self._hybrid_fqns:
            return None
        parts = sharding_option.hybrid_choice.comm_bytes
        inp = (parts["lengths"] + parts["cold_ids"]) / MB
        out = (parts["partials"] / 2) / MB
        ranks = list(shard.ranks)
        return ranks, [inp] * len(ranks), [out] * len(ranks)
