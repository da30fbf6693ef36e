"""Projected (not measured) bytes per rank per step on large clusters, from the cost model.

For each Criteo 1TB table (capped at 40M rows as in the MLPerf DLRM reference) we draw ids from the project's
synthetic Zipf generator (`ZipfSampler` of torchrec_hybrid/stats/synthetic.py), rank rows by
their count in one sample and measure, on a second independent sample, which share of
lookups the top-H rows cover (out of sample, so the coverage is not flattered by the rows
the ranking was made from). The cost model (torchrec_hybrid/planner/cost_model.py) then
prices every sharding type for W = 8 .. 1024 ranks at a fixed per-rank batch (weak
scaling), one id per feature or the MLPerf DLRMv2 multi-hot bag sizes (``--multi-hot``).
Hybrid rows: a fixed number of hot rows across all tables (like the measured headline) and the
cost model's best H per table (`FrequencyHybrid.best_hot_rows`), both with even row-wise cold blocks; and, per
cold layout, the best H per table for that layout (`FrequencyHybrid.layout_bytes`): row-wise cold (even
blocks) and table-wise cold (one owner per table: a multi-hot bag returns one partial sum).
Figures are means over ranks; placing whole tables (table_wise, table-wise cold) loads some
ranks more than others, which the mean does not show.

Usage: python -m benchmarks.simulate [--samples N] [--out DIR]
"""

import argparse
import json
import logging
import os
from typing import Dict, List, Sequence

import torch
from tqdm import tqdm

from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.stats.synthetic import CRITEO_TERABYTE_CARDINALITIES, DLRMV2_MULTI_HOT_SIZES, ZipfSampler

logger = logging.getLogger(__name__)
LABEL = "projected, not measured"
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)


def measured_coverage(rows: int, alpha: float, samples: int, max_hot: int, seed: int) -> torch.Tensor:
    """coverage[H], H = 0..max_hot: out-of-sample share of lookups on the top-H rows."""
    g = torch.Generator().manual_seed(seed)
    sampler = ZipfSampler(rows, alpha, g)
    rank_sample, eval_sample = sampler.sample(samples, g), sampler.sample(samples, g)
    del sampler
    ids, counts = torch.unique(rank_sample, return_counts=True)
    order = torch.sort(counts, descending=True, stable=True).indices[:max_hot]
    top = ids[order]                                   # most frequent first
    if top.numel() == 0:
        return torch.zeros(max_hot + 1, dtype=torch.float64)
    srt, pos = torch.sort(top)
    where = torch.searchsorted(srt, eval_sample).clamp_(max=srt.numel() - 1)
    rank_of = torch.where(srt[where] == eval_sample, pos[where], torch.full_like(where, max_hot))
    per_rank = torch.bincount(rank_of, minlength=max_hot + 1)[:max_hot].to(torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(per_rank, 0) / samples])


def global_top(coverages: Sequence[torch.Tensor], total: int, pooling: Sequence[float] = ()) -> List[int]:
    """Rows per table of the `total` most frequent rows across tables: each table's coverage gains
    weighted by its ids per bag (``pooling``; default 1 each), its lookups per sample (a table with
    bags of 100 ids sees 100 times the lookups of a one-id table, as the measured hot sets count them)."""
    weights = list(pooling) or [1.0] * len(coverages)
    gains = torch.cat([(c[1:] - c[:-1]) * float(p) for c, p in zip(coverages, weights)])
    table = torch.cat([torch.full((c.numel() - 1,), i) for i, c in enumerate(coverages)])
    chosen = table[torch.sort(gains, descending=True, stable=True).indices[:total]]
    return torch.bincount(chosen, minlength=len(coverages)).tolist()


def layout_best_bytes(t: cm.TableTraffic, coverage: torch.Tensor, layout: str) -> float:
    """Mean bytes per rank of one hybrid table with its cold rows laid out ``layout``
    (``row_wise``: even blocks; ``table_wise``: one owner), at that layout's best H."""
    w = t.world
    if layout == "row_wise":
        shares, counts = torch.tensor([1.0 / w]), torch.tensor([float(w)])
    else:
        shares, counts = torch.tensor([1.0, 0.0]), torch.tensor([1.0, float(w - 1)])
    h = torch.arange(coverage.numel(), dtype=torch.float64)
    return float(cm.HYBRID.layout_bytes(t, coverage, h, shares, counts).min())


def simulate(cardinalities: Sequence[int] = CRITEO_TERABYTE_CARDINALITIES, alpha: float = 1.1,
             dim: int = 128, batch: int = 1024, samples: int = 1_000_000, max_hot: int = 100_000,
             fixed_hot: int = 2000, worlds: Sequence[int] = WORLDS, seed: int = 0,
             multi_hot: bool = False) -> Dict:
    """Projected bytes per rank per step per sharding type and W (see module docstring)."""
    # coverage depends on the table size and alpha only (the permutation just relabels
    # rows), so tables of equal size share one measured histogram
    by_size = {n: measured_coverage(n, alpha, samples, min(n, max_hot), seed + n)
               for n in tqdm(sorted(set(cardinalities)), desc="histograms", unit="size")}
    covs = [by_size[n] for n in cardinalities]
    pooling = list(DLRMV2_MULTI_HOT_SIZES) if multi_hot else [1] * len(cardinalities)
    fixed = global_top(covs, fixed_hot, pooling)
    out = {"label": LABEL, "alpha": alpha, "dim": dim, "batch_per_rank": batch, "samples_per_table": samples,
           "cardinalities": list(cardinalities), "pooling": pooling, "fixed_hot_rows_total": fixed_hot,
           "worlds": list(worlds),
           "bytes": {k: [] for k in ("table_wise", "column_wise", "row_wise", "data_parallel",
                                     f"frequency_hybrid_top{fixed_hot}", "frequency_hybrid_best_H",
                                     "frequency_hybrid_row_wise_cold", "frequency_hybrid_table_wise_cold")},
           "best_hot_rows_total": [], "cold_fraction_fixed": None}
    for w in tqdm(worlds, desc="world sizes", unit="W"):
        ts = [cm.TableTraffic(rows=n, dim=dim, features=1, pooling=float(p), batch=batch, world=w)
              for n, p in zip(cardinalities, pooling)]
        for kind in ("table_wise", "row_wise", "data_parallel"):
            out["bytes"][kind].append(sum(cm.model(kind).mean_bytes(t) for t in ts))
        out["bytes"]["column_wise"].append(sum(cm.model("column_wise").mean_bytes(t, shards=2) for t in ts))
        out["bytes"][f"frequency_hybrid_top{fixed_hot}"].append(
            sum(float(cm.HYBRID.mean_bytes(t, c[h], h)) for t, c, h in zip(ts, covs, fixed)))
        best = [cm.HYBRID.best_hot_rows(t, c) for t, c in zip(ts, covs)]
        out["bytes"]["frequency_hybrid_best_H"].append(
            sum(float(cm.HYBRID.mean_bytes(t, c[h], h)) for t, c, h in zip(ts, covs, best)))
        out["best_hot_rows_total"].append(sum(best))
        for layout in ("row_wise", "table_wise"):
            out["bytes"][f"frequency_hybrid_{layout}_cold"].append(
                sum(layout_best_bytes(t, c, layout) for t, c in zip(ts, covs)))
    # the share of all lookups that are cold: each table's weighted by its ids per bag
    out["cold_fraction_fixed"] = 1.0 - sum(float(c[h]) * p for c, h, p in zip(covs, fixed, pooling)) / sum(pooling)
    return out


def plot(sim: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, ys in sim["bytes"].items():
        ax.plot(sim["worlds"], [y / 1e6 for y in ys], marker="o", label=kind,
                linestyle="-" if kind.startswith("frequency") else "--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("MB sent per rank per step")
    ax.set_title(f"PROJECTED, NOT MEASURED\nCriteo 1TB (40M cap), Zipf {sim['alpha']:g}, "
                 f"dim {sim['dim']}, B={sim['batch_per_rank']}/rank"
                 f"{', DLRMv2 multi-hot' if max(sim.get('pooling', [1])) > 1 else ', one-hot'}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(sim: Dict) -> str:
    kinds = list(sim["bytes"])
    lines = [f"## Projected bytes per rank per step ({LABEL})", "",
             f"Criteo 1TB cardinalities (MLPerf 40M cap), Zipf {sim['alpha']:g} ids (synthetic, "
             f"{sim['samples_per_table']:,} sampled lookups per table), dim {sim['dim']}, "
             f"{'DLRMv2 multi-hot bag sizes' if max(sim.get('pooling', [1])) > 1 else 'one id per feature'}, "
             f"B={sim['batch_per_rank']} per rank. Cold fraction with the top {sim['fixed_hot_rows_total']} "
             f"rows hot: {sim['cold_fraction_fixed']:.3f}.", "",
             "| W | " + " | ".join(kinds) + " | best H total |", "|---:|" + "---:|" * (len(kinds) + 1)]
    for i, w in enumerate(sim["worlds"]):
        cells = [f"{sim['bytes'][k][i] / 1e6:,.2f} MB" for k in kinds]
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {sim['best_hot_rows_total'][i]:,} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000, help="sampled lookups per table (x2)")
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--prefix", default=None, help="file name prefix (default: projected[_multihot])")
    p.add_argument("--multi-hot", action="store_true", help="MLPerf DLRMv2 bag sizes instead of one id")
    a = p.parse_args(argv)
    if a.samples < 1:
        p.error(f"--samples must be >= 1, got {a.samples}")
    if not 0 <= a.alpha < float("inf"):  # NaN fails this too
        p.error(f"--alpha must be a finite Zipf exponent >= 0, got {a.alpha}")
    a.prefix = a.prefix or ("projected_multihot" if a.multi_hot else "projected")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    sim = simulate(alpha=a.alpha, samples=a.samples, multi_hot=a.multi_hot)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.prefix}.json"), "w") as f:
        json.dump(sim, f, indent=1)
    with open(os.path.join(a.out, f"{a.prefix}.md"), "w") as f:
        f.write(markdown(sim))
    plot(sim, os.path.join(a.out, f"{a.prefix}_bytes_vs_W.png"))
    logger.info("wrote %s/%s.{json,md} and %s_bytes_vs_W.png (%s)", a.out, a.prefix, a.prefix, LABEL)
    return sim


if __name__ == "__main__":
    main()
