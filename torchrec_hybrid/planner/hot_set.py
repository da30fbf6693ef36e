"""Hot-set sizing: how many rows of each table to replicate.

Per table the step cost as a function of H (``cost_model.hybrid_cost_curve``) is evaluated
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
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from torchrec_hybrid.planner import cost_model as cm

logger = logging.getLogger(__name__)


@dataclass
class TableProfile:
    """One table's inputs to the sizing: traffic, coverage curve, ids in rank order, memory."""

    traffic: cm.TableTraffic
    coverage: torch.Tensor  # [K+1], coverage[H] for H = 0..K
    ranked_ids: Optional[torch.Tensor]  # [K] row ids, most frequent first (None: unknown)
    bytes_per_hot_row: int
    source: str = "stats"
    shares: Optional[torch.Tensor] = None  # owners' shares of cold lookups (None: even row-wise)
    # the owners (per entry of shares) that look it up through virtual features on FBGEMM's scalar CPU
    # backward (plan_cost.virtual_owners; None: none)
    virtual: Optional[torch.Tensor] = None


def profile_from_stats(stats, table: str, traffic: cm.TableTraffic, bytes_per_hot_row: int,
                       max_rows: int) -> TableProfile:
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
    return TableProfile(traffic, cov, ids.cpu().to(torch.int64), bytes_per_hot_row, "stats")


def profile_uniform(traffic: cm.TableTraffic, bytes_per_hot_row: int, max_rows: int,
                    ranked_ids: Optional[torch.Tensor] = None, source: str = "uniform") -> TableProfile:
    """No statistics: every row equally likely (so replication never pays off by itself)."""
    k = max_rows if ranked_ids is None else min(max_rows, ranked_ids.numel())
    return TableProfile(traffic, cm.uniform_coverage(traffic.rows, k), ranked_ids, bytes_per_hot_row, source)


def cost_curve(p: TableProfile, a2a_bw: float, hot_bw: float,
               compute: Optional[cm.ComputeCosts] = None) -> torch.Tensor:
    """Step cost (ms) per step for H = 0..K: bytes / bandwidth of the layout if the profile
    names owner shares (``p.shares``), else of the even row-wise one; plus, with
    ``compute`` prices, the mean rank's compute work."""
    h = torch.arange(p.coverage.numel(), dtype=torch.float64)
    if p.shares is None:
        curve = cm.hybrid_cost_curve(p.traffic, p.coverage, a2a_bw, hot_bw)
        shares = torch.full((p.traffic.world,), 1.0 / p.traffic.world, dtype=torch.float64)
    else:
        curve = cm.hybrid_layout_bytes(p.traffic, p.coverage, h, p.shares) / a2a_bw
        shares = p.shares
    if compute is not None:
        sent = cm.hybrid_layout_bytes(p.traffic, p.coverage, h, shares)
        curve = curve + compute.ms(cm.hybrid_mean_work(p.traffic, p.coverage, h, shares, virtual=p.virtual), sent)
    return curve


def choose_hot_rows(profiles: Dict[str, TableProfile], budget_bytes: Optional[float],
                    a2a_bw: float = 1.0, hot_bw: float = 1.0,
                    fixed: Optional[Dict[str, int]] = None,
                    compute: Optional[cm.ComputeCosts] = None) -> Dict[str, int]:
    """H per table minimising the summed step cost within ``budget_bytes`` (per rank).

    ``fixed`` tables keep the given H (e.g. the sharder's explicit hot ids) and use budget; fixed
    sets alone over the budget are refused (ValueError), as a plan over it would not be kept.
    """
    fixed = dict(fixed or {})
    curves = {n: cost_curve(p, a2a_bw, hot_bw, compute) for n, p in profiles.items() if n not in fixed}
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


def hot_ids_for(p: TableProfile, hot_rows: int) -> Optional[torch.Tensor]:
    """The ``hot_rows`` most frequent ids, sorted (None when the profile has no ids)."""
    if p.ranked_ids is None:
        return None
    return torch.sort(p.ranked_ids[:hot_rows]).values


def coverage_at(p: TableProfile, hot_rows: int) -> float:
    return float(p.coverage[min(hot_rows, p.coverage.numel() - 1)])


def row_lookup_shares(p: TableProfile, hot_rows: int) -> torch.Tensor:
    """Each row's share of the table's cold lookups once the ``hot_rows`` most frequent are
    hot, ``[rows]`` float64 (rows never counted share the unseen mass evenly; unknown ids:
    uniform). Plan-time only: O(rows) memory."""
    rows = p.traffic.rows
    ranked = p.ranked_ids
    known = 0 if ranked is None else min(ranked.numel(), p.coverage.numel() - 1)
    h = min(hot_rows, known)
    tail = max(0.0, 1.0 - float(p.coverage[known])) / max(1, rows - known)
    share = torch.full((rows,), tail, dtype=torch.float64)
    if ranked is not None and known:
        counts = p.coverage[1:known + 1] - p.coverage[:known]
        share[ranked[:known]] = counts.to(torch.float64)
        share[ranked[:h]] = 0.0
    total = float(share.sum())
    return share / total if total > 0 else torch.full((rows,), 1.0 / max(1, rows), dtype=torch.float64)


def block_loads(p: TableProfile, hot_rows: int, bounds) -> Tuple[torch.Tensor, torch.Tensor]:
    """For row blocks ``bounds`` ([W+1]): each owner's share of the cold lookups and the
    number of hot rows it owns (and sends to every replica each step)."""
    from torchrec_hybrid.row_blocks import owners

    b = torch.as_tensor(bounds, dtype=torch.int64)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(row_lookup_shares(p, hot_rows), 0)])
    shares = cum[b[1:]] - cum[b[:-1]]
    world = b.numel() - 1
    hot = torch.zeros(world, dtype=torch.float64)
    ids = hot_ids_for(p, hot_rows)
    if ids is not None and ids.numel():
        hot = torch.bincount(owners(ids, b), minlength=world).to(torch.float64)
    elif hot_rows:  # ids unknown: spread like the rows
        hot = (b[1:] - b[:-1]).to(torch.float64) / max(1, p.traffic.rows) * hot_rows
    return shares, hot


def balanced_row_bounds(p: TableProfile, hot_rows: int, world: int):
    """Row blocks of equal owner-side cost: cold lookups (a partial sum to a remote rank each,
    one-hot) and hot rows (sent to every other rank each step), from the statistics."""
    from torchrec_hybrid.row_blocks import balanced_bounds

    t = p.traffic
    per_step_lookups = t.lookups * t.world  # global lookups of the table per step
    cold_total = max(0.0, 1.0 - coverage_at(p, hot_rows)) * per_step_lookups
    # expected cold lookups per row, each a partial sum to a remote rank w.p. (W-1)/W
    cost = row_lookup_shares(p, hot_rows) * cold_total * (world - 1) / world
    ids = hot_ids_for(p, hot_rows)
    if ids is not None and ids.numel():
        cost[ids] = float(world - 1)  # a hot row: one row-sized send per other rank
    return balanced_bounds(cost, world)
