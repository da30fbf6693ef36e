"""Counting throughput of FrequencyStats on one core: exact counts and the sketch.

Runs with torch.set_num_threads(1) so the numbers are ids/s per core. Batches are
generated before timing; each configuration is timed several times and the median pass
is reported (the machine may be shared). Prints a small table and one JSON line.

    .venv/bin/python -m benchmarks.bench_stats [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from torchrec_hybrid.stats import FrequencyStats, SyntheticCriteo, criteo_table_sizes, criteo_tables
from torchrec_hybrid.stats.synthetic import ZipfSampler


def time_passes(make_stats, batches, repeats):
    """Median seconds to count all batches into a fresh FrequencyStats."""
    times = []
    for _ in range(repeats):
        stats = make_stats()
        start = time.perf_counter()
        for kjt in batches:
            stats.update(kjt)
        times.append(time.perf_counter() - start)
    return statistics.median(times), stats


def bench_exact(args, max_rows):
    """26 Criteo-Kaggle tables capped at max_rows, one-hot Zipf(1.1), exact counts."""
    sizes = criteo_table_sizes(max_rows=max_rows)
    tables = criteo_tables(sizes)
    batches = list(SyntheticCriteo(sizes, args.batch_size, args.batches, alpha=1.1, seed=0))
    ids = sum(k.values().numel() for k in batches)
    sec, _ = time_passes(lambda: FrequencyStats(tables), batches, args.repeats)
    # the bare primitive: one bincount over ids already shifted into the flat vector
    offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
    flat = [torch.cat([jt.values() + o for jt, o in zip(k.to_dict().values(), offsets)]) for k in batches]
    start = time.perf_counter()
    for f in flat:
        torch.bincount(f, minlength=sum(sizes))
    raw = ids / (time.perf_counter() - start)
    return {"ids": ids, "seconds": sec, "ids_per_s": ids / sec, "bincount_ids_per_s": raw,
            "memory_bytes": 8 * sum(sizes), "rows": sum(sizes)}


def bench_sketch(args):
    """One 10M-row table, Zipf(1.1) ids, counted by the sketch; recall of the true top 1%."""
    n = args.sketch_rows
    g = torch.Generator().manual_seed(0)
    ids = ZipfSampler(n, 1.1, g).sample(args.sketch_ids, g)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batches = [KeyedJaggedTensor(keys=["f"], values=v, lengths=torch.ones(v.numel(), dtype=torch.int32))
               for v in ids.split(args.batch_size * 26)]
    true = torch.bincount(ids, minlength=n)
    k = int((true > 0).sum()) // 100
    tables = criteo_tables([n], feature_names=["f"])

    def make():
        return FrequencyStats(tables, exact_max_rows=0, sketch_capacity=2 * k,
                              sketch_eps=args.sketch_eps, sketch_delta=args.sketch_delta)

    sec, stats = time_passes(make, batches, args.repeats)
    sk = stats.sketch(tables[0].name)
    found, _ = sk.top(k)
    top = torch.sort(true, descending=True, stable=True).indices[:k]
    recall = float(np.isin(found.numpy(), top.numpy()).mean())
    return {"ids": ids.numel(), "seconds": sec, "ids_per_s": ids.numel() / sec,
            "memory_bytes": sk.memory_bytes(), "memory_bound_bytes": sk.memory_bound_bytes(),
            "exact_memory_bytes": 8 * n, "depth": sk.depth, "width": sk.width,
            "capacity": sk.capacity, "top_k": k, "recall_top1pct": recall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="smaller run")
    p.add_argument("--kaggle-full", action="store_true",
                   help="also count the uncapped Kaggle tables (33.8M rows, 270 MB counters)")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sketch-rows", type=int, default=10_000_000)
    p.add_argument("--sketch-ids", type=int, default=10_000_000)
    p.add_argument("--sketch-eps", type=float, default=1e-5)
    p.add_argument("--sketch-delta", type=float, default=0.05)
    args = p.parse_args()
    if args.quick:
        args.batches, args.repeats, args.sketch_ids = 5, 2, 2_000_000
    torch.set_num_threads(1)
    exact, sketch = bench_exact(args, args.max_rows), bench_sketch(args)
    full = bench_exact(args, None) if args.kaggle_full else None
    print(f"{'mode':<8}{'ids':>12}{'M ids/s/core':>14}{'memory MB':>12}  notes")
    for r in [exact] + ([full] if full else []):
        print(f"{'exact':<8}{r['ids']:>12,}{r['ids_per_s'] / 1e6:>14.1f}"
              f"{r['memory_bytes'] / 1e6:>12.1f}  26 tables, {r['rows']:,} rows; "
              f"bare bincount {r['bincount_ids_per_s'] / 1e6:.0f}M/s")
    print(f"{'sketch':<8}{sketch['ids']:>12,}{sketch['ids_per_s'] / 1e6:>14.1f}"
          f"{sketch['memory_bytes'] / 1e6:>12.1f}  {args.sketch_rows:,} rows (exact "
          f"{sketch['exact_memory_bytes'] / 1e6:.0f} MB), d={sketch['depth']} w={sketch['width']}, "
          f"recall of top {sketch['top_k']:,} = {sketch['recall_top1pct']:.4f}")
    print(json.dumps({"bench": "stats", "threads": 1, "exact": exact, "exact_kaggle_full": full,
                      "sketch": sketch}))


if __name__ == "__main__":
    main()
