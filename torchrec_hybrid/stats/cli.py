"""``python -m torchrec_hybrid.stats``: count lookups over a dataset, report coverage.

Reads a synthetic Criteo-like stream, Criteo TSV files or preprocessed Criteo .npy days,
counts per-row lookups with `FrequencyStats`, prints per table the share of lookups that
the most frequent 100 / 1k / 10k / 100k rows cover, writes the statistics file and,
optionally, a coverage-curve PNG.

Example::

    python -m torchrec_hybrid.stats --synthetic --max-rows 100000 --num-batches 50 \\
        --out stats.pt --plot coverage.png
"""

from __future__ import annotations

import argparse
import logging
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from torchrec_hybrid.stats.frequency import DEFAULT_EXACT_MAX_ROWS, FrequencyStats
from torchrec_hybrid.stats.selection import coverage_curve
from torchrec_hybrid.stats.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_TERABYTE_CARDINALITIES,
    SyntheticCriteo,
    criteo_table_sizes,
    criteo_tables,
)

logger = logging.getLogger("torchrec_hybrid.stats")

CARDINALITIES = {"kaggle": CRITEO_KAGGLE_CARDINALITIES, "terabyte": CRITEO_TERABYTE_CARDINALITIES}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchrec_hybrid.stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", action="store_true", help="Criteo-like Zipf stream")
    src.add_argument("--criteo-tsv", nargs="+", metavar="FILE", help="Criteo TSV files")
    src.add_argument("--criteo-npy", metavar="DIR", help="dir of day_N_{dense,sparse,labels}.npy")
    p.add_argument("--cardinalities", choices=sorted(CARDINALITIES), default="kaggle")
    p.add_argument("--scale", type=float, default=1.0, help="multiply table sizes")
    p.add_argument("--max-rows", type=int, default=None, help="cap table sizes")
    p.add_argument("--embedding-dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--num-batches", type=int, default=100, help="synthetic batches")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many")
    p.add_argument("--alpha", type=float, default=1.1, help="synthetic Zipf exponent")
    p.add_argument("--multi-hot", action="store_true", help="synthetic DLRMv2 multi-hot sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact-max-rows", type=int, default=DEFAULT_EXACT_MAX_ROWS)
    p.add_argument("--sketch-capacity", type=int, default=100_000)
    p.add_argument("--sketch-eps", type=float, default=1e-5)
    p.add_argument("--hot-sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[100, 1000, 10_000, 100_000], help="comma list for the table")
    p.add_argument("--out", default="stats.pt", help="statistics file to write")
    p.add_argument("--plot", default=None, help="coverage-curve PNG to write")
    return p


def _source(args, sizes: List[int]) -> Tuple[Iterable, Optional[int]]:
    if args.synthetic:
        data = SyntheticCriteo(sizes, args.batch_size, args.num_batches, args.alpha,
                               args.multi_hot, args.seed)
        return data, len(data)
    if args.criteo_npy:
        from torchrec_hybrid.stats.sources import criteo_npy_dataset

        data = criteo_npy_dataset(args.criteo_npy, sizes, args.batch_size)
        return (b.sparse_features for b in data), len(data)
    from torchrec_hybrid.stats.sources import criteo_tsv_batches

    return criteo_tsv_batches(args.criteo_tsv, sizes, args.batch_size), None


def format_table(stats: FrequencyStats, hot_sizes: Sequence[int]) -> str:
    """Rows, lookups, counting mode and coverage at each hot size, per table."""
    head = ["table", "rows", "lookups", "mode"] + [f"cov@{s:,}" for s in hot_sizes]
    lines = [head]
    for name in stats.table_names:
        cov = coverage_curve(stats, name, hot_sizes).tolist()
        lines.append([name, f"{stats.config(name).num_embeddings:,}", f"{stats.lookups(name):,}",
                      "exact" if stats.is_exact(name) else "sketch"] + [f"{c:.3f}" for c in cov])
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines)


def plot_coverage(stats: FrequencyStats, path: str) -> None:
    """Fraction of lookups covered vs hot rows (log x), one line per table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    for name in stats.table_names:
        n = max(1, stats.top_counts(name)[0].numel())
        sizes = np.unique(np.geomspace(1, n, num=min(n, 200)).round().astype(np.int64))
        ax.plot(sizes, coverage_curve(stats, name, sizes.tolist()).numpy(), label=name, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("hot rows")
    ax.set_ylabel("fraction of lookups covered")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # force: importing torch/torchrec already attached a WARNING-level root handler
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        force=True)
    sizes = criteo_table_sizes(CARDINALITIES[args.cardinalities], args.scale, args.max_rows)
    stats = FrequencyStats(criteo_tables(sizes, args.embedding_dim),
                           exact_max_rows=args.exact_max_rows,
                           sketch_capacity=args.sketch_capacity, sketch_eps=args.sketch_eps,
                           seed=args.seed)
    logger.info("%d tables, %s rows; counter memory %.1f MB", len(sizes), f"{sum(sizes):,}",
                sum(stats.memory_bytes().values()) / 1e6)
    batches, total = _source(args, sizes)
    if args.max_batches is not None and total is not None:
        total = min(total, args.max_batches)
    for i, kjt in enumerate(tqdm(batches, total=total, unit="batch", desc="counting")):
        if args.max_batches is not None and i >= args.max_batches:
            break
        stats.update(kjt)
    logger.info("counted %d batches, %d samples", stats.num_batches, stats.num_samples)
    stats.save(args.out)
    logger.info("wrote statistics to %s", args.out)
    if args.plot:
        plot_coverage(stats, args.plot)
        logger.info("wrote coverage plot to %s", args.plot)
    print(format_table(stats, args.hot_sizes))
    return 0
