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
import math
import os
import sys
import tempfile
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from torchrec_hybrid.stats.frequency import DEFAULT_EXACT_MAX_ROWS, FrequencyStats
from torchrec_hybrid.stats.selection import coverage_curve
from torchrec_hybrid.stats.sources import criteo_npy_dataset, criteo_tsv_batches
from torchrec_hybrid.stats.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_TERABYTE_CARDINALITIES,
    SyntheticCriteo,
    criteo_table_sizes,
    criteo_tables,
)

logger = logging.getLogger("torchrec_hybrid.stats")

CARDINALITIES = {"kaggle": CRITEO_KAGGLE_CARDINALITIES, "terabyte": CRITEO_TERABYTE_CARDINALITIES}


def _number(kind, lo: float, lo_ok: bool, hi: Optional[float] = None, what: str = ""):
    """An argparse ``type`` that parses `kind` and refuses values outside the range;
    argparse then reports ``argument --flag: must be ..., got 'value'``."""
    bound = (">= " if lo_ok else "> ") + f"{lo:g}" + (f" and < {hi:g}" if hi is not None else "")
    name = what or ("an integer" if kind is int else "a number")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {name} {bound}, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (v == lo and not lo_ok) or (hi is not None and v >= hi):
            raise argparse.ArgumentTypeError(f"must be {name} {bound}, got {text!r}")
        return v

    parse.__name__ = f"{kind.__name__} {bound}"
    return parse


def _hot_sizes(text: str) -> List[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers >= 1, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers >= 1, got {text!r}")
    return sizes


POSITIVE_INT = _number(int, 1, True)
# flags that shape the synthetic stream only (refused with real data), and their defaults
SYNTHETIC_DEFAULTS = {"num_batches": 100, "alpha": 1.1, "multi_hot": False}
NONNEG_INT = _number(int, 0, True)


def build_parser() -> argparse.ArgumentParser:
    launched = os.path.basename(sys.argv[0])  # the console script's name, or __main__.py under python -m
    prog = "python -m torchrec_hybrid.stats" if launched in ("__main__.py", "cli.py", "") else launched
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", action="store_true", help="Criteo-like Zipf stream")
    src.add_argument("--criteo-tsv", nargs="+", metavar="FILE", help="Criteo TSV files")
    src.add_argument("--criteo-npy", metavar="DIR", help="dir of day_N_{dense,sparse,labels}.npy")
    p.add_argument("--cardinalities", choices=sorted(CARDINALITIES), default="kaggle")
    p.add_argument("--scale", type=_number(float, 0, False), default=1.0, help="multiply table sizes (> 0)")
    p.add_argument("--max-rows", type=POSITIVE_INT, default=None, help="cap table sizes (>= 1; default: no cap)")
    p.add_argument("--embedding-dim", type=POSITIVE_INT, default=128)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=4096)
    p.add_argument("--num-batches", type=POSITIVE_INT, default=None,
                   help=f"synthetic batches (default {SYNTHETIC_DEFAULTS['num_batches']}; real data: --max-batches)")
    p.add_argument("--max-batches", type=POSITIVE_INT, default=None, help="stop after this many")
    p.add_argument("--alpha", type=_number(float, 0, True), default=None,
                   help=f"synthetic Zipf exponent (>= 0; 0: uniform; default {SYNTHETIC_DEFAULTS['alpha']})")
    p.add_argument("--multi-hot", action="store_true", help="synthetic DLRMv2 multi-hot sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact-max-rows", type=NONNEG_INT, default=DEFAULT_EXACT_MAX_ROWS,
                   help="count tables up to this many rows exactly, sketch larger ones (0: sketch all)")
    p.add_argument("--sketch-capacity", type=POSITIVE_INT, default=100_000)
    p.add_argument("--sketch-eps", type=_number(float, 0, False, 1), default=1e-5)
    p.add_argument("--hot-sizes", type=_hot_sizes,
                   default=[100, 1000, 10_000, 100_000], help="comma list for the table")
    p.add_argument("--out", default="stats.pt", help="statistics file to write")
    p.add_argument("--plot", default=None, help="coverage-curve PNG to write")
    return p


def check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse missing inputs, unwritable outputs and synthetic-only flags with real data before
    counting (not after); fill in the synthetic defaults."""
    if not args.synthetic:
        # given: not the parser's default (None, or False for a switch); `not in (None, False)` took --alpha 0 for none
        given = [f"--{k.replace('_', '-')}" for k in SYNTHETIC_DEFAULTS
                 if getattr(args, k) is not None and getattr(args, k) is not False]
        if given:
            p.error(f"argument {', '.join(given)}: only for --synthetic data (real data is counted as it is; "
                    "--max-batches stops early)")
    for k, v in SYNTHETIC_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for f in args.criteo_tsv or []:
        if not os.path.isfile(f):
            p.error(f"argument --criteo-tsv: {f!r} is not a file")
    if args.criteo_npy is not None and not os.path.isdir(args.criteo_npy):
        p.error(f"argument --criteo-npy: {args.criteo_npy!r} is not a directory")
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is None:
            continue
        if os.path.isdir(path):
            p.error(f"argument {flag}: {path!r} is a directory; give a file name")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            p.error(f"argument {flag}: the directory of {path!r} ({parent}) does not exist")
        try:  # a file can be created there (permissions, read-only or pseudo file systems): a probe, removed
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".stats-probe-"):
                pass
        except OSError as e:
            p.error(f"argument {flag}: cannot write into {parent} ({e.strerror or e})")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            p.error(f"argument {flag}: {path!r} exists and cannot be written")
    if args.plot is not None:
        ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if ext != "png":  # the coverage curve is written as a PNG (plots need no other format)
            p.error(f"argument --plot: {args.plot!r}: give a .png file name")
    if not -2 ** 63 <= args.seed < 2 ** 63:
        p.error(f"argument --seed: must fit 64 bits (a torch.Generator seed), got {args.seed}")


def _source(args, sizes: List[int]) -> Tuple[Iterable, Optional[int]]:
    if args.synthetic:
        data = SyntheticCriteo(sizes, args.batch_size, args.num_batches, args.alpha,
                               args.multi_hot, args.seed)
        return data, len(data)
    if args.criteo_npy:
        data = criteo_npy_dataset(args.criteo_npy, sizes, args.batch_size)
        return (b.sparse_features for b in data), len(data)
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


# (colour, line style) per series: at most this many lines share a panel, each unique in
# colour and in style, so they stay apart in grey-scale print too
LINE_STYLES = [("tab:blue", "-"), ("tab:orange", "--"), ("tab:green", "-."), ("tab:red", ":"),
               ("tab:purple", (0, (5, 1, 1, 1, 1, 1))), ("tab:brown", (0, (8, 3))),
               ("black", (0, (1, 3)))]
SERIES_PER_PANEL = len(LINE_STYLES)


def plot_coverage(stats: FrequencyStats, path: str) -> None:
    """Fraction of lookups covered vs hot rows (log x): one line per table, at most
    `SERIES_PER_PANEL` tables per panel (tables by size, largest first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(stats.table_names, key=lambda n: (-stats.config(n).num_embeddings, n))
    groups = [names[i:i + SERIES_PER_PANEL] for i in range(0, len(names), SERIES_PER_PANEL)]
    cols = min(2, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, group in zip(axes.flat, groups):
        for name, (color, style) in zip(group, LINE_STYLES):
            n = max(1, stats.top_counts(name)[0].numel())
            sizes = np.unique(np.geomspace(1, n, num=min(n, 200)).round().astype(np.int64))
            rows_n = stats.config(name).num_embeddings
            ax.plot(sizes, coverage_curve(stats, name, sizes.tolist()).numpy(), color=color,
                    linestyle=style, lw=1.4, label=f"{name} ({rows_n:,} rows)")
        lo, hi = stats.config(group[-1]).num_embeddings, stats.config(group[0]).num_embeddings
        ax.set_title(f"tables of {lo:,} rows" if lo == hi else f"tables of {lo:,} to {hi:,} rows", fontsize=9)
        ax.set_xscale("log")
        ax.set_xlabel("hot rows (log scale)")
        ax.set_ylabel("fraction of lookups covered")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_paths(parser, args)
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
