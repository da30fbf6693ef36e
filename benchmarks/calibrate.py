"""Fit the planner's compute prices (``cost_model.ComputeCosts``) from measured steps.

The byte model prices what crosses the network; what a rank computes besides (TBE lookups,
the sharding's own packing and index work, the fixed ops of each sharding group) is priced
by a linear model of the work terms ``cost_model.WORK_TERMS``. This script measures it the
way a user's job runs: W gloo ranks, the Criteo tables of the product benchmark, several
workloads, and per workload several plans (TorchRec's planner's, ours planned on bytes alone,
and table_wise, column_wise, small-tables-data_parallel and frequency_hybrid plans, so every
term varies, and the two plans the planner chooses between with the machine's current
prices: its own choice and every table frequency_hybrid as those prices lay it out), trained
step by step with the
order of the plans rotated. Per rank and plan it records the CPU time of a step (process
time: immune to the other ranks sharing the cores) and the model's work and bytes for that
rank, then fits non-negative prices by least squares:

    cpu_ms[rank] - bytes[rank] / bandwidth = work[rank] . prices + bytes[rank] * ns_per_byte

Results: ``<out>.json`` (every measurement and the fit) and ``<out>.md`` (fit and
per-plan error). The CPU defaults in ``torchrec_hybrid/planner/compute_costs.py`` are the
committed fit (a test checks they match ``benchmarks/results/calibration.json``).

    python -m benchmarks.calibrate --steps 12 --out out/cal_big1            # ~2 minutes, 2 cores
    python -m benchmarks.calibrate --steps 12 --rows-cap 10000 --batch 256 --out out/cal_small1
    python -m benchmarks.calibrate --refit out/cal_big*.json out/cal_small*.json --out benchmarks/results/calibration
    python -m benchmarks.calibrate --steps 12 --network 2gbit --out out/cal_2gbit   # ranks on a shaped loopback

The committed fit pools three runs at the product's sizes and two at the sweep's (10k-row
tables, B=256): at one size the fixed per-group terms and the per-unit ones move together,
and the fit that sees only large batches prices a hybrid group's fixed work too low for
small ones. Its steps trained on a plain sum (a broadcast gradient); ``calibration_dense.json``
is the re-fit of runs on the mean square (two rounds of five, the second at the first round's
prices), not the default (docs/architecture.md). The runs now train on
``benchmarks.models.training_loss`` (a fixed random linear function: a dense gradient, no other work).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from benchmarks import malloc, shaped_loopback
from benchmarks.spawner import spawn_ranks
from benchmarks.workloads import WORKLOADS, fused_params, workload_data

logger = logging.getLogger(__name__)

PLANS = ("stock_planner", "hybrid_planner", "table_wise", "column_wise", "small_data_parallel", "all_hybrid",
         "priced_planner", "priced_all_hybrid")
SMALL_ROWS = 10_000  # "small_data_parallel": tables below this many rows data_parallel, the rest table_wise


def _plans(tables, stats, spec, world: int, pg):
    """Every plan of :data:`PLANS` with its sharding options and the traffic it was priced on."""
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, HybridEmbeddingShardingPlanner
    from torchrec_hybrid import _compat
    from torchrec_hybrid.planner import cost_model as cm
    from torchrec_hybrid.types import FREQUENCY_HYBRID

    fused = fused_params()
    topo = Topology(world_size=world, compute_device="cpu")
    hyb = HybridEmbeddingBagCollectionSharder(fused_params=dict(fused))
    stock = EmbeddingBagCollectionSharder(fused_params=dict(fused))

    def ebc():
        return torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

    def only(sharding_type: str) -> Dict[str, ParameterConstraints]:
        """Every table of at least 1,000 rows this type (smaller ones: the planner's choice)."""
        return {t.name: ParameterConstraints(sharding_types=[sharding_type]) for t in tables
                if t.num_embeddings >= 1000}

    out: Dict[str, Any] = {}
    hp = HybridEmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"], frequency_stats=stats,
                                        compute_costs=cm.ComputeCosts())
    out["hybrid_planner"] = (hp.collective_plan(ebc(), [hyb], pg), hp.planned_options(), hyb)
    traffic = hp.traffic_table()
    small_dp = {t.name: ParameterConstraints(sharding_types=["data_parallel" if t.num_embeddings < SMALL_ROWS
                                                             else "table_wise"]) for t in tables}
    for name, cons in (("stock_planner", None), ("table_wise", only("table_wise")),
                       ("column_wise", only("column_wise")), ("small_data_parallel", small_dp)):
        sp = EmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"], constraints=cons)
        out[name] = (sp.collective_plan(ebc(), [stock], pg), _compat.planner_best_plan(sp), stock)
    ap = HybridEmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"], frequency_stats=stats,
                                        constraints=only(FREQUENCY_HYBRID), compare_plans=False,
                                        compute_costs=cm.ComputeCosts())
    out["all_hybrid"] = (ap.collective_plan(ebc(), [hyb], pg), ap.planned_options(), hyb)
    # the plans the planner chooses between with the current prices (the machine's default): its
    # own choice, and every table frequency_hybrid with layouts and hot sets sized by those prices
    pp = HybridEmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"], frequency_stats=stats)
    out["priced_planner"] = (pp.collective_plan(ebc(), [hyb], pg), pp.planned_options(), hyb)
    pa = HybridEmbeddingShardingPlanner(topology=topo, batch_size=spec["batch"], frequency_stats=stats,
                                        constraints=only(FREQUENCY_HYBRID), compare_plans=False)
    out["priced_all_hybrid"] = (pa.collective_plan(ebc(), [hyb], pg), pa.planned_options(), hyb)
    return out, traffic, topo


def _rank_main(rank: int, world: int, emit, spec: Dict[str, Any], rows_cap: int, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from benchmarks.models import training_loss
    from benchmarks.step_counts import count_training_step
    from torchrec_hybrid.planner import cost_model as cm

    tables, stats, batches = workload_data(spec, world, rank, rows_cap, 8, warmup + steps)
    plans, traffic, topo = _plans(tables, stats, spec, world, dist.GroupMember.WORLD)
    models = {n: DistributedModelParallel(torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                                          device=torch.device("cpu"), plan=p, sharders=[s])
              for n, (p, _, s) in plans.items()}
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    cpu: Dict[str, List[float]] = {n: [] for n in models}
    wall: Dict[str, List[float]] = {n: [] for n in models}
    names = list(models)
    for i, kjt in enumerate(batches):
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotated order: no plan always runs first
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            training_loss(models[name](kjt).wait().values()).backward()
            if i >= warmup:
                cpu[name].append((time.process_time() - c0) * 1e3)
                wall[name].append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    collectives = {}
    for name in names:  # one more, untimed, step per plan under the dispatch counter
        dist.barrier()
        c = count_training_step(models[name], batches[-1])
        collectives[name] = c["fwd_collectives"] + c["bwd_collectives"]
    out = {"cpu_ms": {n: statistics.median(v) for n, v in cpu.items()}, "wall_ms": wall,
           "collectives": collectives}
    if rank == 0:
        costs = {n: cm.plan_rank_cost(o, traffic, world) for n, (_, o, _) in plans.items()}
        out["work"] = {n: work.tolist() for n, (_, work) in costs.items()}
        out["bytes"] = {n: sent.tolist() for n, (sent, _) in costs.items()}
        out["a2a_bytes_per_ms"] = cm.a2a_bandwidth(topo)
        out["allocator"] = malloc.current()
    emit(out)


def measure(workload: str, world: int, rows_cap: int, warmup: int, steps: int,
            batch: Optional[int] = None) -> Dict[str, Any]:
    """One workload's plans trained and timed (``batch``: samples per rank instead of the
    workload's own; other sizes than the product's let the fit tell fixed from per-unit work)."""
    spec = dict(WORKLOADS[workload], **({"batch": batch} if batch else {}))
    per_rank = [r[0] for r in spawn_ranks(_rank_main, world, timeout=3000, spec=spec,
                                          rows_cap=rows_cap, warmup=warmup, steps=steps)]
    r0 = per_rank[0]
    sized = batch is not None or rows_cap != 100_000
    label = f"{workload} B={spec['batch']} cap {rows_cap // 1000}k" if sized else workload
    return {"workload": label, "world": world, "allocator": r0["allocator"], "a2a_bytes_per_ms": r0["a2a_bytes_per_ms"],
            "plans": {n: {"cpu_ms": [r["cpu_ms"][n] for r in per_rank], "work": r0["work"][n],
                          "bytes": r0["bytes"][n],
                          # the slowest rank's wall time of each step, median over steps
                          "step_ms": statistics.median(max(step) for step in zip(*(r["wall_ms"][n] for r in per_rank))),
                          "collectives": max(r["collectives"][n] for r in per_rank)}
                      for n in r0["work"]}}


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set; small problems)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=0.0) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Non-negative prices of the work terms (and a per-byte CPU cost) from every rank of
    every plan and workload; and per plan the mean and busiest rank, measured vs fitted."""
    from torchrec_hybrid.planner import cost_model as cm

    rows, ys, keys = [], [], []
    for i, res in enumerate(results):
        bw = res["a2a_bytes_per_ms"]
        for name, p in res["plans"].items():
            for r, (w, b, y) in enumerate(zip(p["work"], p["bytes"], p["cpu_ms"])):
                rows.append(list(w) + [b])
                ys.append(y - b / bw)
                keys.append((i, name))
    a, y = np.array(rows), np.array(ys)
    scale = np.maximum(np.abs(a).max(0), 1e-30)  # column scaling for a well-conditioned fit
    x = nnls(a / scale, y) / scale
    # ns per unit for the element/id terms, ms per group, ns per byte
    prices = dict(zip(cm.WORK_TERMS, x[:-1].tolist()))
    costs = {t: prices[t] * 1e6 for t in cm.WORK_TERMS if not t.startswith("group")}
    costs.update(group_stock_ms=prices["group_stock"], group_hybrid_ms=prices["group_hybrid"],
                 ns_per_byte=float(x[-1]) * 1e6)
    pred = a @ x
    per_plan = []
    for i, res in enumerate(results):
        bw = res["a2a_bytes_per_ms"]
        for name, p in res["plans"].items():
            idx = [j for j, k in enumerate(keys) if k == (i, name)]
            meas = np.array(p["cpu_ms"])
            model = pred[idx] + np.array(p["bytes"]) / bw
            per_plan.append({"workload": res["workload"], "plan": name, "measured_mean_ms": float(meas.mean()),
                             "model_mean_ms": float(model.mean()), "measured_busiest_ms": float(meas.max()),
                             "model_busiest_ms": float(model.max())})
    resid = y - pred
    rms = float(np.sqrt((resid ** 2).mean()))
    measured = float(np.mean([y for res in results for p in res["plans"].values() for y in p["cpu_ms"]]))
    out = {"costs": costs, "rms_ms": rms, "rms_rel": rms / measured, "per_plan": per_plan}
    steps = fit_step(results, per_plan)
    if steps is not None:
        out["step_fit"] = steps
        costs["collective_ms"] = steps["collective_ms"]
        costs["busiest_share"] = steps["busiest_share"]
    return out


def fit_step(results: List[Dict[str, Any]], per_plan: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """How a step follows the ranks' modelled costs, from the measured step (wall time of the
    slowest rank): ``step_ms = a * busiest-rank model ms + m * mean-rank model ms + b *
    collectives + c`` fitted (non-negative) over every plan and workload. The busiest rank
    sets ``busiest_share = a / (a + m)`` of a step (1 with a rank per device; less where ranks
    share cores, and the step follows their total work), and a collective costs ``b / (a + m)``
    of the model's (per-rank) ms: what the CPU fit cannot see, since a rank waiting for a peer
    that shares its core burns no CPU. None when the measurements have no step times (older runs).
    The collectives are the ones each plan really issued (the dispatch hook): the stock plans
    here run under TorchRec's sharder, whose collectives the planner counts for stock tables
    under ours too (cost_model.collectives_per_step: the id check rides their splits exchange)."""
    rows, ys = [], []
    plans = [p for res in results for p in res["plans"].values()]
    if not plans or any("step_ms" not in p for p in plans):
        return None
    for p, pp in zip(plans, per_plan):
        rows.append([pp["model_busiest_ms"], pp["model_mean_ms"], p["collectives"], 1.0])
        ys.append(p["step_ms"])
    a, y = np.array(rows), np.array(ys)
    scale = np.maximum(np.abs(a).max(0), 1e-30)
    x = nnls(a / scale, y) / scale
    pred = a @ x
    for pp, p, f in zip(per_plan, plans, pred):
        pp.update(measured_step_ms=float(p["step_ms"]), model_step_ms=float(f), collectives=int(p["collectives"]))
    per_model = float(x[0] + x[1])
    return {"per_busiest_ms": float(x[0]), "per_mean_ms": float(x[1]), "per_collective_ms": float(x[2]),
            "intercept_ms": float(x[3]), "busiest_share": float(x[0]) / per_model if per_model > 0 else 1.0,
            "collective_ms": float(x[2]) / per_model if per_model > 0 else 0.0,
            "rms_ms": float(np.sqrt(((y - pred) ** 2).mean()))}


def report(fitted: Dict[str, Any], world: int) -> List[str]:
    c = fitted["costs"]
    lines = [f"# Compute prices fitted from measured steps ({world} gloo ranks, CPU)", "",
             "| term | price |", "|---|---:|"]
    for k, v in c.items():
        unit = ("ms per collective" if k == "collective_ms" else "of a step" if k == "busiest_share"
                else "ms per group" if k.endswith("_ms")
                else "ns per byte" if k == "ns_per_byte" else "ns per unit")
        lines.append(f"| {k} | {v:.4g} {unit} |")
    lines += ["", f"RMS error per rank: {fitted['rms_ms']:.2f} ms"
              + (f" ({fitted['rms_rel']:.1%} of the mean measured rank)" if "rms_rel" in fitted else "")]
    s = fitted.get("step_fit")
    if s:
        lines += ["", f"Step (slowest rank's wall time, median) = {s['per_busiest_ms']:.3g} x busiest-rank model ms "
                  f"+ {s['per_mean_ms']:.3g} x mean-rank model ms + {s['per_collective_ms']:.3g} ms per collective "
                  f"+ {s['intercept_ms']:.3g} ms (RMS error {s['rms_ms']:.2f} ms): the busiest rank sets "
                  f"{s['busiest_share']:.2f} of a step (busiest_share) and a collective costs "
                  f"{s['collective_ms']:.3g} model ms (collective_ms)."]
    step_cols = " | step ms: measured / fitted | collectives" if s else ""
    lines += ["", f"| workload | plan | CPU ms per step, mean rank: measured / model | busiest rank: measured / model"
              f"{step_cols} |", "|---|---|---:|---:|" + ("---:|---:|" if s else "")]
    for p in fitted["per_plan"]:
        extra = (f" | {p['measured_step_ms']:.1f} / {p['model_step_ms']:.1f} | {p['collectives']}"
                 if "measured_step_ms" in p else "")
        lines.append(f"| {p['workload']} | {p['plan']} | {p['measured_mean_ms']:.1f} / {p['model_mean_ms']:.1f} "
                     f"| {p['measured_busiest_ms']:.1f} / {p['model_busiest_ms']:.1f}{extra} |")
    return lines


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)  # a shaped run's process gets the same arguments
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["onehot", "multihot", "uniform"], choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=None,
                    help="samples per rank in every workload (default: each workload's own, as benchmarks.product)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.path.join("out", "calibration"), help="path prefix of the .json/.md")
    ap.add_argument("--refit", nargs="+", metavar="JSON",
                    help="fit again from the measurements of earlier runs (their .json files), measuring nothing")
    ap.add_argument("--network", default=shaped_loopback.UNSHAPED, metavar="RATE",
                    help="the ranks' loopback shaped to RATE (tc's spelling: 500mbit, 2gbit), so their bytes cost "
                         "time: this module re-run in a network namespace (benchmarks/shaped_loopback.py; needs "
                         "unshare and tc); default unshaped")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    measuring = ("world", "workloads", "rows_cap", "batch", "warmup", "steps", "network")
    try:
        args.network = shaped_loopback.parse_rate("--network", args.network)
        inside = shaped_loopback.current_rate()  # set: this is the shaped run's process, in its namespace
    except ValueError as e:
        ap.error(str(e))
    for name, low in (("world", 1), ("rows_cap", 1), ("warmup", 0), ("steps", 1), ("batch", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.refit:
        given = [f"--{k.replace('_', '-')}" for k in measuring if getattr(args, k) != ap.get_default(k)]
        if given:
            ap.error(f"{', '.join(given)}: set how to measure, but --refit measures nothing (the files' runs set them)")
        results, worlds = [], set()
        for path in args.refit:  # several runs: the fit averages their noise
            try:
                with open(path) as f:
                    run = json.load(f)
                results += run["measurements"]
                worlds.add(run["args"]["world"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                ap.error(f"--refit {path}: not a calibration results file of benchmarks.calibrate ({e!r})")
        if len(worlds) != 1:
            ap.error(f"--refit: the files were measured at different world sizes {sorted(worlds)}; fit one at a time")
        args.world = worlds.pop()  # the report's world: the runs', not the default
        for k in measuring[1:]:  # not this command's settings: each run's are in its measurements' labels
            setattr(args, k, None)
    elif args.network != shaped_loopback.UNSHAPED and inside is None:  # this module again, in the namespace
        try:
            shaped_loopback.check_available("--network", args.network)
        except shaped_loopback.ShapingUnavailable as e:
            ap.error(str(e))
        code = shaped_loopback.run_module(args.network, "benchmarks.calibrate", argv)
        if code != 0:
            raise SystemExit(code)
        return
    else:
        if inside is not None and inside != args.network:
            ap.error(f"{shaped_loopback.ENV}={inside}: this process runs on a loopback shaped to {inside}, not "
                     f"--network {args.network}")
        from tqdm import tqdm

        results = [dict(measure(w, args.world, args.rows_cap, args.warmup, args.steps, args.batch),
                        network=args.network) for w in tqdm(args.workloads, desc="workloads")]
    fitted = fit(results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "measurements": results, "fit": fitted}, f, indent=1)
    lines = report(fitted, args.world)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
