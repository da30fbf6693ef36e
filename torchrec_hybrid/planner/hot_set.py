"""Hot-set sizing: how many rows of each table to replicate.

Per table the step cost as a function of H (``cost_model.TableProfile.cost_curve``) is evaluated
for every H up to a cap, from the table's lookup histogram (rows sorted by count). The
unconstrained choice is the brute-force argmin per table. Hot replicas cost memory on every
rank, so when their sum exceeds the per-rank budget the tables compete: we minimise
``sum_t cost_t(H_t)`` subject to ``sum_t H_t * bytes_per_row_t <= budget`` with a Lagrange
multiplier (bisection on lambda; each table then takes ``argmin cost_t(H) + lambda *
bytes_per_row_t * H``). Because counts are sorted, each cost curve is convex up to ties,
so this is the optimum up to one table's last rows.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch

from torchrec_hybrid.planner import cost_model as cm

logger = logging.getLogger(__name__)


def profile_from_stats(stats, table: str, traffic: cm.TableTraffic, bytes_per_hot_row: int,
                       max_rows: int) -> cm.TableProfile:
    """Coverage and ranked ids of ``table`` from a ``FrequencyStats`` (exact or sketched);
    ValueError when they count another number of rows than the table has (statistics of
    another model)."""
    counted = next((c.num_embeddings for c in getattr(stats, "tables", []) if c.name == table), None)
    total = stats.lookups(table)
    ids, counts = stats.top_counts(table, max_rows)
    if counted not in (None, traffic.rows) or (ids.numel() and int(ids.max()) >= traffic.rows):
        seen = f"count {counted} rows" if counted not in (None, traffic.rows) else f"name row {int(ids.max())}"
        raise ValueError(f"frequency statistics of table '{table}' {seen}, but the table has {traffic.rows} rows: "
                         "statistics of another model? Count them on this model's tables")
    if total <= 0:
        ids, counts = ids[:0], counts[:0]
    cov = cm.coverage_from_counts(counts.cpu(), total=total if total > 0 else 1.0)  # ranked; decayed totals may be < 1
    return cm.TableProfile(traffic, cov, ids.cpu().to(torch.int64), bytes_per_hot_row, "stats")


def profile_uniform(traffic: cm.TableTraffic, bytes_per_hot_row: int, max_rows: int,
                    ranked_ids: Optional[torch.Tensor] = None, source: str = "uniform") -> cm.TableProfile:
    """No statistics: every row equally likely (so replication never pays off by itself)."""
    k = max_rows if ranked_ids is None else min(max_rows, ranked_ids.numel())
    return cm.TableProfile(traffic, cm.uniform_coverage(traffic.rows, k), ranked_ids, bytes_per_hot_row, source)


def choose_hot_rows(profiles: Dict[str, cm.TableProfile], budget_bytes: Optional[float], bw: float = 1.0,
                    fixed: Optional[Dict[str, int]] = None,
                    compute: Optional[cm.ComputeCosts] = None) -> Dict[str, int]:
    """H per table minimising the summed step cost (bytes at ``bw``, and ``compute`` prices) within
    ``budget_bytes`` (per rank).

    ``fixed`` tables keep the given H (e.g. the sharder's explicit hot ids) and use budget; fixed
    sets alone over the budget are refused (ValueError), as a plan over it would not be kept.
    """
    fixed = dict(fixed or {})
    curves = {n: p.cost_curve(bw, compute) for n, p in profiles.items() if n not in fixed}
    sizes = {n: float(p.bytes_per_hot_row) for n, p in profiles.items()}
    used_fixed = sum(fixed[n] * sizes[n] for n in fixed)

    def pick(lam: float) -> Dict[str, int]:
        out = {}
        for n, c in curves.items():
            h = torch.arange(c.numel(), dtype=torch.float64)
            out[n] = int(torch.argmin(c + lam * sizes[n] * h))
        return out

    def used(choice: Dict[str, int]) -> float:
        return used_fixed + sum(h * sizes[n] for n, h in choice.items())

    if budget_bytes is not None and used_fixed > budget_bytes:
        raise ValueError(f"the sharder's hot_ids ({', '.join(f'{n}: {h} rows' for n, h in fixed.items())}) need "
                         f"{used_fixed:.0f} B per rank with their optimizer state, over the hot-row budget of "
                         f"{budget_bytes:.0f} B (hot_budget_bytes; by default a quarter of a rank's memory): pass a "
                         "larger hot_budget_bytes or fewer hot_ids")
    best = pick(0.0)
    if budget_bytes is None or used(best) <= budget_bytes:
        return {**best, **fixed}
    hi = max([float((c[0] - c.min()) / sizes[n]) + 1.0 for n, c in curves.items()] + [1.0])
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if used(pick(mid)) <= budget_bytes:
            hi = mid
        else:
            lo = mid
    chosen = pick(hi)
    logger.info("hot-row budget %d B binds: %d B used (lambda %.3g)", budget_bytes, used(chosen), hi)
    return {**chosen, **fixed}
