"""FBGEMM's CPU TBE on one table looked up by one feature, and by W virtual features of it.

The owner of a frequency_hybrid table with table-wise cold rows gets about the global batch
of that table's cold bags, so its lookup splits each feature into W virtual features of the
same table (``cells.LaneLayout``; the other features' batches stay small). FBGEMM's CPU
backward has a vectorised path (SpMDM and the row-wise AdaGrad kernel) only for
EXACT_ROWWISE_ADAGRAD on a table looked up by one feature; virtual features take its scalar
path. This measures what that costs: the same one-id bags through one TBE of one feature and
through one of W virtual features, forward and backward (the fused update included), in
alternation, each timed with the thread's CPU clock, median over repeats, at several sizes.
``extra_share`` is the virtual layout's extra backward per id over the one-feature lookup's
forward + backward per id: the slopes of least-squares lines through the sizes (a call's fixed
part is no lookup work: the cost model prices it per sharding group). It is the share of a
lookup's work the cost model adds for such an owner (``cost_model.VIRTUAL_BACKWARD_EXTRA``,
priced at the fitted lookup price; a test keeps the two equal).

    python -m benchmarks.tbe_paths --out benchmarks/results   # the committed run, ~1 min
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks.report import write_results

logger = logging.getLogger(__name__)


def _tbe(rows: int, dim: int, features: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                         SplitTableBatchedEmbeddingBagsCodegen)

    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], feature_table_map=[0] * features,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8, pooling_mode=PoolingMode.SUM)


def _times(tbe, ids: torch.Tensor, offsets: torch.Tensor) -> List[float]:
    """Forward and backward (with the fused update) CPU seconds of one step."""
    t0 = time.thread_time()
    out = tbe(ids, offsets)
    t1 = time.thread_time()
    out.backward(torch.ones_like(out))
    return [t1 - t0, time.thread_time() - t1]


def measure(ids_per_step: int, rows: int, dim: int, world: int, repeats: int, warmup: int = 5,
            seed: int = 0) -> Dict[str, Any]:
    """Both layouts on the same one-id bags (``ids_per_step`` of them, a multiple of ``world``)."""
    g = torch.Generator().manual_seed(seed)
    n = ids_per_step - ids_per_step % world
    ids = torch.randint(0, rows, (n,), generator=g)
    offsets = torch.arange(n + 1)
    tbes = {"one feature": _tbe(rows, dim, 1), f"{world} virtual features": _tbe(rows, dim, world)}
    times: Dict[str, List[List[float]]] = {k: [] for k in tbes}
    for i in range(warmup + repeats):
        for name in (list(tbes) if i % 2 == 0 else list(tbes)[::-1]):
            t = _times(tbes[name], ids, offsets)
            if i >= warmup:
                times[name].append(t)
    ms = {k: {"forward_ms": statistics.median(t[0] for t in v) * 1e3,
              "backward_ms": statistics.median(t[1] for t in v) * 1e3} for k, v in times.items()}
    one, virtual = ms["one feature"], ms[f"{world} virtual features"]
    return {"ids": n, "layouts": ms, "backward_ratio": virtual["backward_ms"] / one["backward_ms"],
            "lookup_ms": one["forward_ms"] + one["backward_ms"],
            "extra_ms": virtual["backward_ms"] - one["backward_ms"]}


def slope(x: List[float], y: List[float]) -> float:
    """The least-squares slope of ``y`` over ``x``."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, nargs="+", default=[512, 1800, 6000],
                    help="one-id bags per step (an owner's cold lookups of one table)")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=4, help="virtual features per feature (the ranks)")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--out", default="out/tbe_paths")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    runs = []
    for n in args.ids:
        logger.info("%d ids per step", n)
        runs.append(measure(n, args.rows, args.dim, args.world, args.repeats))
    ids = [float(r["ids"]) for r in runs]
    per_id = {k: slope(ids, [r[k] for r in runs]) for k in ("lookup_ms", "extra_ms")}
    result = {"args": vars(args), "torch": torch.__version__, "runs": runs,
              "lookup_ns_per_id": per_id["lookup_ms"] * 1e6, "extra_ns_per_id": per_id["extra_ms"] * 1e6,
              "extra_share": per_id["extra_ms"] / per_id["lookup_ms"]}
    lines = [f"# FBGEMM CPU TBE, EXACT_ROWWISE_ADAGRAD: one feature vs {args.world} virtual features of one table",
             "", f"{args.rows} rows x {args.dim}, one-id bags, thread CPU time, median of {args.repeats} "
             "alternating steps.", "",
             "| ids per step | layout | forward ms | backward ms | backward vs one feature |",
             "|---:|---|---:|---:|---:|"]
    for r in runs:
        for i, (name, t) in enumerate(r["layouts"].items()):
            ratio = f"{r['backward_ratio']:.2f}x" if i else "-"
            lines.append(f"| {r['ids']} | {name} | {t['forward_ms']:.3f} | {t['backward_ms']:.3f} | {ratio} |")
    lines += ["", f"Per id (slopes over the sizes): the one-feature lookup's forward + backward "
              f"{result['lookup_ns_per_id']:.1f} ns, the virtual layout's extra backward "
              f"{result['extra_ns_per_id']:.1f} ns: extra share {result['extra_share']:.2f}."]
    print(write_results(args.out, "tbe_paths", result, lines))
    return result


if __name__ == "__main__":
    main()
