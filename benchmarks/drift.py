"""Drift: hot sets that follow the data, against a frozen one, an ideal one and the stock plan.

    .venv/bin/python -m benchmarks.drift                                  # default, ~2 min here
    .venv/bin/python -m benchmarks.drift --out benchmarks/results/drift   # the committed run
    .venv/bin/python -m benchmarks.drift --tiny                           # seconds (tests)

W gloo ranks train four models of the same EmbeddingBagCollection (26 Criteo-Kaggle tables
capped at ``--rows-cap`` rows, EXACT_ROWWISE_ADAGRAD, every table ``frequency_hybrid`` with
even row blocks for the hybrids) on the same drifting batches (``SyntheticCriteo`` with
``drift_rows``: every table's popularity ranking rotates ``--drift-rows`` ranks per batch, ids
rising into the head, ``drift_mode="rise"``), step by step, in one process group:

- ``static``: the hybrid with the hot set chosen once, before training, from
  ``--stats-batches`` batches (the ``--hot-rows`` most frequent rows over all tables);
- ``refreshed``: the same hybrid; every rank counts the ids it trains on in decayed statistics
  (``--decay auto``, the default: ``AdaptiveHotSets``, several decays at once, the one whose last
  hot sets served the interval best chosen at each refresh; or one ``FrequencyStats`` decayed by
  ``--decay`` per batch), and every ``--every`` steps the ranks merge them (``--merge top``, the
  default: ``merged_top_ids``, each rank's top candidates; ``dense``: ``all_reduce_`` of every
  counter) and switch the hot sets (``refresh_hot_sets``: same size per table, no weights or
  optimizer state move);
- ``ideal``: the same hybrid, its hot sets re-chosen at the same steps from the data's true
  top ids at that batch (``SyntheticCriteo.top_ids``: what perfect, fresh statistics give);
- ``stock``: TorchRec's ``EmbeddingShardingPlanner`` plan (stock sharder, same topology).

Each step runs the four models in a balanced order (``stepping.step_models``), each behind a
barrier; around each model's forward + backward, the bytes each rank writes to its sockets are read from
``/proc/self/io`` (``torchrec_hybrid.comm_bytes.sent_bytes``); nothing prints or logs inside.
Counting, merging and switching happen outside those windows; merge and switch are timed and
their bytes counted separately. Reported per measured point (``--point`` steps): bytes per
rank per step, the mean over ranks and the busiest rank, of each model; the refresh's cost
(time, slowest rank; bytes per rank); ratios to the ideal and to stock. Writes
``drift.json``, ``drift.md`` and ``drift.png`` (bytes per step over time) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.data import rank_slice  # one rank's part of a global batch

from torchrec_hybrid.comm_bytes import count_sent_bytes
from benchmarks import malloc
from benchmarks.spawner import spawn_ranks
from benchmarks.stepping import step_models
from benchmarks.workloads import fused_params, types_text

logger = logging.getLogger("benchmarks.drift")

MODELS = ("static", "refreshed", "ideal", "stock")
HYBRIDS = ("static", "refreshed", "ideal")
DEFAULTS = dict(world=2, batch=512, rows_cap=100_000, dim=32, alpha=1.1, drift_rows=1.0, hot_rows=2000,
                steps=1000, every=25, decay="auto", stats_batches=8, point=50, warmup=2, merge="top", oversample=2.0)
TINY = dict(world=2, batch=64, rows_cap=2000, dim=16, alpha=1.1, drift_rows=4.0, hot_rows=200,
            steps=12, every=4, decay="auto", stats_batches=2, point=4, warmup=1, merge="top", oversample=2.0)


def _rank_main(rank: int, world: int, emit, a: Dict[str, Any]) -> None:
    torch.set_num_threads(1)
    from torchrec_hybrid.stats import FrequencyStats, SyntheticCriteo, criteo_table_sizes, criteo_tables

    sizes = criteo_table_sizes(max_rows=a["rows_cap"])
    tables = criteo_tables(sizes, embedding_dim=a["dim"])
    gen = SyntheticCriteo(sizes, batch_size=a["batch"] * world,
                          num_batches=a["stats_batches"] + a["warmup"] + a["steps"],
                          alpha=a["alpha"], seed=0, drift_rows=a["drift_rows"])
    stream = iter(gen)
    stats0, hot0 = _initial_hot_set(stream, tables, a)
    pg = dist.GroupMember.WORLD
    models, stock_types = _build_models(tables, hot0, world, a["batch"], pg)
    hot_size = {t.name: int(hot0[t.name].numel()) for t in tables}
    if a["decay"] == "auto":  # the decay chosen at each refresh from how the last proposals served
        from torchrec_hybrid.stats.adaptive import AdaptiveHotSets

        streaming: Any = AdaptiveHotSets(tables, oversample=a["oversample"])
    else:
        streaming = FrequencyStats(tables, decay=float(a["decay"]))
    run = _train(rank, world, a, gen, stream, models, stats0, streaming, hot_size,
                 {t.name: t.feature_names[0] for t in tables}, pg)
    dist.barrier()
    emit({**run, "hot_rows": sum(hot_size.values()), "tables_with_hot_rows": sum(1 for n in hot_size.values() if n),
          "stock_types": stock_types, "rows": sum(sizes),
          "stats_bytes": int(sum(sum(s.memory_bytes().values()) for s in getattr(
              streaming, "stats", {0: streaming}).values())), "allocator": malloc.current(),
          "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


def _initial_hot_set(stream, tables, a: Dict[str, Any]):
    """The hot set chosen once, before training, from the first ``stats_batches`` global batches; and the
    statistics it came from (they price coverage later)."""
    from torchrec_hybrid.stats import FrequencyStats, select_hot_ids

    stats0 = FrequencyStats(tables)
    for _ in range(a["stats_batches"]):  # the same global batches on every rank: no merge needed
        stats0.update(next(stream))
    hot0 = select_hot_ids(stats0, memory_budget_bytes=a["hot_rows"] * a["dim"] * 4,
                          bytes_per_row=lambda c: c.embedding_dim * 4)
    return stats0, hot0


def _build_models(tables, hot0, world: int, batch: int, pg):
    """The four models: three all-``frequency_hybrid`` DMPs starting from ``hot0`` and the stock planner's DMP;
    with the stock plan's table count per sharding type."""
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from torchrec_hybrid import HybridEmbeddingBagCollectionSharder, frequency_hybrid

    fused = fused_params()

    def ebc():
        return torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

    models: Dict[str, Any] = {}
    for name in HYBRIDS:
        sharder = HybridEmbeddingBagCollectionSharder(hot_ids=hot0, fused_params=dict(fused))
        module = ebc()
        plan = construct_module_sharding_plan(module, {t.name: frequency_hybrid() if t.num_embeddings >= world else
                                                        frequency_hybrid(cold="table_wise", rank=0) for t in tables},
                                              sharder=sharder, local_size=world, world_size=world,
                                              device_type="cpu")
        models[name] = DistributedModelParallel(module, device=torch.device("cpu"), plan=ShardingPlan({"": plan}),
                                                sharders=[sharder])
    stock_sharder = EmbeddingBagCollectionSharder(fused_params=dict(fused))
    stock_plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                          batch_size=batch).collective_plan(ebc(), [stock_sharder], pg)
    models["stock"] = DistributedModelParallel(ebc(), device=torch.device("cpu"), plan=stock_plan,
                                               sharders=[stock_sharder])
    stock_types: Dict[str, int] = {}
    for ps in next(iter(stock_plan.plan.values())).values():
        stock_types[ps.sharding_type] = stock_types.get(ps.sharding_type, 0) + 1
    return models, stock_types


def _train(rank: int, world: int, a: Dict[str, Any], gen, stream, models: Dict[str, Any], stats0, streaming,
           hot_size: Dict[str, int], feature_of: Dict[str, str], pg) -> Dict[str, Any]:
    """The warm-up and timed steps of all four models on the same batches: per-step bytes and times, the
    refreshes' records and each hot set's coverage at every point."""
    bar = _progress_bar(rank, world, a)
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window
    sent: Dict[str, List[int]] = {m: [] for m in MODELS}
    times: Dict[str, List[float]] = {m: [] for m in MODELS}
    refreshes: List[Dict[str, Any]] = []
    coverage: Dict[str, List[float]] = {m: [] for m in HYBRIDS}
    batches = [next(stream) for _ in range(a["warmup"])]  # warm-up: the first batches, untimed
    for i in range(a["warmup"] + a["steps"]):
        glob_kjt = batches[i] if i < a["warmup"] else next(stream)
        kjt = rank_slice(glob_kjt, gen.hotness, rank, a["batch"])
        timed = i >= a["warmup"]
        step_models(models, MODELS, kjt, i - a["warmup"], timed, sent, times)  # rows counted from the first timed step
        if timed:
            s = i - a["warmup"] + 1  # timed steps done
            streaming.update(kjt)  # what a trainer counts: the ids this rank trained on
            if s % a["point"] == 0 or s == a["steps"]:  # coverage of the global batch by each hot set
                for name in HYBRIDS:
                    hot = _hot_ids(models[name])
                    coverage[name].append(_share(stats0, glob_kjt, hot))
            if s % a["every"] == 0 and s < a["steps"]:
                nxt = a["stats_batches"] + i + 1  # index of the next batch in the generator
                refreshes.append(_refresh(models, streaming, pg, s, check=not refreshes, a=a, hot_size=hot_size,
                                          ideal_ids=lambda: _ideal_hot_ids(gen, nxt, hot_size, feature_of)))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return {"sent": sent, "times": times, "refreshes": refreshes, "coverage": coverage}


def _progress_bar(rank: int, world: int, a: Dict[str, Any]):
    """Rank 0's tqdm bar over all steps (None on the other ranks), without tqdm's monitor thread."""
    if rank != 0:
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread writing inside a measured window
    return tqdm(total=a["warmup"] + a["steps"], desc=f"drift W={world}", unit="step", disable=not a["progress"])


def _refresh(models: Dict[str, Any], streaming, pg, step: int, check: bool, a: Dict[str, Any],
             hot_size: Dict[str, int], ideal_ids: Callable[[], Dict[str, torch.Tensor]]) -> Dict[str, Any]:
    """Merge the ranks' statistics and switch ``refreshed``'s hot sets (timed, bytes counted), then switch
    ``ideal``'s to the data's true top ids (``ideal_ids``, computed after the timed part); their record.
    ``a["merge"]``: "dense" sums every counter (``all_reduce_``), "top" gathers each rank's top candidates
    (``merged_top_ids``: ``a["oversample"]`` x each table's hot size)."""
    from torchrec_hybrid import refresh_hot_sets
    from torchrec_hybrid.stats.top_merge import merged_top_ids

    dist.barrier()
    t0 = time.perf_counter()
    hot: Optional[Dict[str, torch.Tensor]] = None
    chosen = None
    with count_sent_bytes() as merge_b:
        if a["decay"] == "auto":
            hot = streaming.hot_ids(hot_size, pg)
            chosen = streaming.chosen
        elif a["merge"] == "dense":
            streaming.all_reduce_(pg, check=check)
        else:
            hot, _ = merged_top_ids(streaming, hot_size, pg, oversample=a["oversample"])
    t1 = time.perf_counter()
    with count_sent_bytes() as switch_b:
        changed = refresh_hot_sets(models["refreshed"], stats=streaming) if hot is None else \
            refresh_hot_sets(models["refreshed"], hot_ids=hot)
    t2 = time.perf_counter()
    ideal = ideal_ids()
    with count_sent_bytes() as ideal_b:
        ideal_changed = refresh_hot_sets(models["ideal"], hot_ids=ideal)
    return {"step": step, "merge_s": t1 - t0, "switch_s": t2 - t1, "merge_bytes": merge_b[0],
            "switch_bytes": switch_b[0], "ideal_switch_bytes": ideal_b[0],
            "changed": int(sum(changed.values())), "ideal_changed": int(sum(ideal_changed.values())),
            "decay": chosen if chosen is not None else float(a["decay"])}


def _ideal_hot_ids(gen, nxt: int, hot_size: Dict[str, int], feature_of: Dict[str, str]) -> Dict[str, torch.Tensor]:
    """Each table's hot set re-chosen, at its current size, from the true top ids of generator batch ``nxt``."""
    top = gen.top_ids(nxt, max(hot_size.values()) or 1)
    return {t: top[feature_of[t]][:n] for t, n in hot_size.items()}


def _hot_ids(model) -> Dict[str, torch.Tensor]:
    from torchrec_hybrid import HybridShardedEmbeddingBagCollection

    out: Dict[str, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, HybridShardedEmbeddingBagCollection):
            out.update(m.hot_ids())
    return out


def _share(stats, kjt, hot) -> float:
    """Share of all lookups of ``kjt`` that ``hot`` serves (HotSetCoverage, all tables)."""
    return stats.coverage_meter(hot).share(kjt)


def summarize(outs: List[Dict[str, Any]], a: Dict[str, Any]) -> Dict[str, Any]:
    world, steps, point = len(outs), len(outs[0]["sent"]["static"]), a["point"]
    bounds = list(range(0, steps, point))
    points = {m: _point_bytes(outs, m, bounds, steps, point) for m in MODELS}
    x = [min(steps, lo + point) for lo in bounds]  # a point is labelled by its last step
    per_step = {m: [statistics.fmean(o["sent"][m][s] for o in outs) for s in range(steps)] for m in MODELS}
    runs = {m: _run_summary(outs, m, points[m], steps) for m in MODELS}
    ideal = points["ideal"]["mean"]
    ratio = {m: [v / i for v, i in zip(points[m]["mean"], ideal)] for m in MODELS}
    busiest_ratio = {m: [v / i for v, i in zip(points[m]["busiest"], points["ideal"]["busiest"])] for m in MODELS}
    refresh = _refresh_summary(outs, a["every"])
    # the refreshed set with each refresh's bytes (merge + switch) spread over the steps of its interval
    spread = 0.0 if refresh is None else \
        (refresh["mean_merge_bytes_per_rank"] + refresh["mean_switch_bytes_per_rank"]) / a["every"]
    with_refresh = [v + spread for v in points["refreshed"]["mean"]]
    ratio["refreshed_with_refresh"] = [v / i for v, i in zip(with_refresh, ideal)]
    after_first = [j for j, last in enumerate(x) if last > a["every"]] or list(range(len(x)))  # past the 1st refresh
    if refresh is not None:
        amortized = (refresh["mean_merge_bytes_per_rank"] + refresh["mean_switch_bytes_per_rank"]) \
            * refresh["count"] / steps
        runs["refreshed"]["mean_bytes_with_refresh"] = runs["refreshed"]["mean_bytes"] + amortized
        saved = (runs["static"]["mean_bytes"] - runs["refreshed"]["mean_bytes"]) * a["every"]
        refresh["merge_share_of_saving"] = refresh["mean_merge_bytes_per_rank"] / saved if saved > 0 else None
    o0 = outs[0]
    return {
        "args": a, "world": world, "steps": steps, "x": x, "points": points, "per_step_mean_bytes": per_step,
        "ratio_to_ideal": ratio, "busiest_ratio_to_ideal": busiest_ratio, "runs": runs, "refresh": refresh,
        "coverage": {"x": [s for s in range(1, steps + 1) if s % point == 0 or s == steps], **o0["coverage"]},
        "hot_rows": o0["hot_rows"], "tables_with_hot_rows": o0["tables_with_hot_rows"],
        "stock_types": o0["stock_types"], "rows": o0["rows"], "stats_bytes_per_rank": o0["stats_bytes"],
        "max_rss_bytes_per_rank": [o["max_rss_bytes"] for o in outs],
        "acceptance": {
            "refreshed_max_over_ideal": max(ratio["refreshed"]),
            "refreshed_within_10pct_of_ideal_at_every_point": max(ratio["refreshed"]) <= 1.10,
            # with the refresh's bytes spread over its interval, at every point after the first refresh
            "refreshed_with_refresh_max_over_ideal": max(ratio["refreshed_with_refresh"][j] for j in after_first),
            "refreshed_with_refresh_within_10pct": max(ratio["refreshed_with_refresh"][j]
                                                       for j in after_first) <= 1.10,
            "merge_share_of_saving": None if refresh is None else refresh["merge_share_of_saving"],
            "static_last_over_ideal": ratio["static"][-1],
            "static_last_over_first": points["static"]["mean"][-1] / points["static"]["mean"][0],
        },
    }


def _point_bytes(outs: List[Dict[str, Any]], m: str, bounds: List[int], steps: int,
                 point: int) -> Dict[str, List[float]]:
    """Model ``m``'s bytes per rank per step at each point (``point`` steps from each of ``bounds``): the mean
    over ranks and the busiest rank's."""
    mean, busiest = [], []
    for lo in bounds:
        hi = min(steps, lo + point)
        per_rank = [statistics.fmean(o["sent"][m][lo:hi]) for o in outs]
        mean.append(statistics.fmean(per_rank))
        busiest.append(max(per_rank))
    return {"mean": mean, "busiest": busiest}


def _run_summary(outs: List[Dict[str, Any]], m: str, points: Dict[str, List[float]], steps: int) -> Dict[str, Any]:
    """Model ``m`` over the whole run: mean and busiest bytes per rank, its first and last point, median step
    (the slowest rank's)."""
    per_rank_mean = [statistics.fmean(o["sent"][m]) for o in outs]
    step_s = [max(o["times"][m][s] for o in outs) for s in range(steps)]
    return {"mean_bytes": statistics.fmean(per_rank_mean), "busiest_bytes": max(per_rank_mean),
            "first_point_bytes": points["mean"][0], "last_point_bytes": points["mean"][-1],
            "median_step_s": statistics.median(step_s)}


def _refresh_summary(outs: List[Dict[str, Any]], every: int) -> Optional[Dict[str, Any]]:
    """The refreshes over ranks (time: the slowest rank; bytes: the mean per rank), each and on average; None
    when there were none."""
    recs = [list(r) for r in zip(*(o["refreshes"] for o in outs))]  # [refresh][rank]
    if not recs:
        return None
    per = [{"step": r[0]["step"], "time_s": max(x["merge_s"] + x["switch_s"] for x in r),
            "merge_s": max(x["merge_s"] for x in r), "switch_s": max(x["switch_s"] for x in r),
            "merge_bytes_per_rank": statistics.fmean(x["merge_bytes"] for x in r),
            "switch_bytes_per_rank": statistics.fmean(x["switch_bytes"] for x in r),
            "ideal_switch_bytes_per_rank": statistics.fmean(x["ideal_switch_bytes"] for x in r),
            "changed": r[0]["changed"], "ideal_changed": r[0]["ideal_changed"], "decay": r[0].get("decay")}
           for r in recs]
    return {"count": len(per), "every": every, "per_refresh": per,
            "mean_time_s": statistics.fmean(p["time_s"] for p in per),
            "max_time_s": max(p["time_s"] for p in per),
            "mean_merge_bytes_per_rank": statistics.fmean(p["merge_bytes_per_rank"] for p in per),
            "mean_switch_bytes_per_rank": statistics.fmean(p["switch_bytes_per_rank"] for p in per)}


def markdown(r: Dict[str, Any]) -> List[str]:
    a, runs = r["args"], r["runs"]
    mb = lambda v: f"{v / 1e6:.3f}"  # noqa: E731
    lines = [f"# Drift: static vs refreshed vs ideal hot sets vs the stock plan (W={r['world']})", "",
             f"{r['world']} gloo ranks, 26 Criteo-Kaggle tables capped at {a['rows_cap']:,} rows ({r['rows']:,} rows), "
             f"dim {a['dim']}, {a['batch']} samples per rank per step, one id per feature, Zipf({a['alpha']:g}), "
             f"drift {a['drift_rows']:g} ranks per batch in every table (rise), {r['hot_rows']:,} hot rows "
             f"({r['tables_with_hot_rows']} tables) chosen from {a['stats_batches']} batches; refresh every "
             f"{a['every']} steps from statistics decayed by "
             + (f"{float(a['decay']):g}" if a["decay"] != "auto" else "a decay chosen at each refresh")
             + f" per batch; {r['steps']} timed steps, "
             f"points of {a['point']} steps. Stock plan: "
             + types_text(r["stock_types"]) + ".", "",
             "| plan | MB / rank / step (mean over run) | busiest rank | first point | last point "
             "| last point / ideal | max over points / ideal | vs stock (mean) | median step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in MODELS:
        q = runs[m]
        lines.append(f"| {m} | {mb(q['mean_bytes'])} | {mb(q['busiest_bytes'])} | {mb(q['first_point_bytes'])} | "
                     f"{mb(q['last_point_bytes'])} | {r['ratio_to_ideal'][m][-1]:.2f}x | "
                     f"{max(r['ratio_to_ideal'][m]):.2f}x | {q['mean_bytes'] / runs['stock']['mean_bytes']:.2f}x | "
                     f"{q['median_step_s'] * 1e3:.1f} ms |")
    acc = r["acceptance"]
    share = acc.get("merge_share_of_saving")
    lines += ["", f"- refreshed / ideal at every point: max **{acc['refreshed_max_over_ideal']:.3f}x** "
              f"({'within' if acc['refreshed_within_10pct_of_ideal_at_every_point'] else 'NOT within'} 10%); "
              f"with each refresh's bytes spread over its interval, after the first refresh: max "
              f"**{acc['refreshed_with_refresh_max_over_ideal']:.3f}x** "
              f"({'within' if acc['refreshed_with_refresh_within_10pct'] else 'NOT within'} 10%)",
              f"- merge ({a.get('merge', 'dense')}): its bytes per refresh are "
              + ("-" if share is None else f"**{100 * share:.1f}%**") + " of the bytes a refresh interval saves "
              "against the static set (bar: 10%)",
              f"- static: its last point is **{acc['static_last_over_ideal']:.2f}x** the ideal's bytes and "
              f"{acc['static_last_over_first']:.2f}x its own first point"]
    rf = r["refresh"]
    if rf:
        wr = runs["refreshed"].get("mean_bytes_with_refresh")
        lines += [f"- refresh ({rf['count']} of them, every {rf['every']} steps): {rf['mean_time_s'] * 1e3:.1f} ms "
                  f"mean, {rf['max_time_s'] * 1e3:.1f} ms max (slowest rank: merge + switch); "
                  f"{rf['mean_merge_bytes_per_rank'] / 1e6:.3f} MB per rank for the merge ("
                  + ("one all-reduce of the statistics" if a.get("merge", "dense") == "dense" else
                     f"one all-gather of each rank's top {a.get('oversample', 2.0):g}x candidates")
                  + f", {r['stats_bytes_per_rank'] / 1e6:.1f} MB of counters), "
                  f"{rf['mean_switch_bytes_per_rank']:.0f} B per rank for the switch (hot-id checks)",
                  f"- refreshed with the refresh bytes spread over the steps: {mb(wr)} MB / rank / step"
                  f" ({wr / runs['ideal']['mean_bytes']:.2f}x ideal, {wr / runs['static']['mean_bytes']:.2f}x static)",
                  "", "| point (last step) | static | refreshed | ideal | stock | refreshed / ideal "
                  "| with refresh bytes / ideal | coverage static / refreshed / ideal |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
    cov = r["coverage"]
    with_refresh = r["ratio_to_ideal"].get("refreshed_with_refresh", r["ratio_to_ideal"]["refreshed"])
    for j, x in enumerate(r["x"]):
        c = " / ".join(f"{cov[m][j]:.3f}" for m in HYBRIDS) if j < len(cov["static"]) else "-"
        lines.append(f"| {x} | " + " | ".join(mb(r["points"][m]["mean"][j]) for m in MODELS)
                     + f" | {r['ratio_to_ideal']['refreshed'][j]:.3f} | {with_refresh[j]:.3f} | {c} |")
    lines += ["", "MB: 10^6 bytes each rank writes to its sockets per training step (forward + backward), "
              "`/proc/self/io`, mean over ranks; busiest: the rank with the most. Coverage: share of all "
              "lookups of the point's last global batch served by the hot rows."]
    return lines


STYLE = {"static": ("tab:red", "o"), "refreshed": ("tab:blue", "s"), "ideal": ("tab:green", "^"),
         "stock": ("tab:gray", "D")}


def plot(r: Dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    for m in MODELS:  # 4 plans x (mean, busiest) = 8 series
        color, marker = STYLE[m]
        ax.plot(r["x"], [v / 1e6 for v in r["points"][m]["mean"]], color=color, marker=marker, markersize=4,
                linestyle="-", lw=1.6, label=f"{m}: mean over ranks")
        ax.plot(r["x"], [v / 1e6 for v in r["points"][m]["busiest"]], color=color, marker=marker, markersize=4,
                markerfacecolor="none", linestyle="--", lw=1.0, label=f"{m}: busiest rank")
    a = r["args"]
    ax.set_xlabel(f"training step (points of {a['point']} steps; refresh every {a['every']})")
    ax.set_ylabel("MB sent per rank per step")
    ax.set_ylim(bottom=0)
    ax.set_title(f"drift {a['drift_rows']:g} ranks/batch: W={r['world']}, B={a['batch']}, cap {a['rows_cap']:,}, "
                 f"{r['hot_rows']:,} hot rows", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long configuration (tests)")
    for k, v in DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v} (tiny {TINY[k]})",
                        **({"choices": ("top", "dense")} if k == "merge" else {}))
    ap.add_argument("--out", default="out/drift", help="output directory (default out/drift)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-progress", action="store_true")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    a: Dict[str, Any] = dict(TINY if ns.tiny else DEFAULTS)
    for k in DEFAULTS:
        if getattr(ns, k) is not None:
            a[k] = getattr(ns, k)
    if a["decay"] != "auto":
        try:
            a["decay"] = float(a["decay"])
        except ValueError:
            ap.error(f"--decay must be 'auto' or a number in (0, 1], got {a['decay']!r}")
    if a["world"] < 2 or a["steps"] < 1 or a["every"] < 1 or a["point"] < 1 \
            or (a["decay"] != "auto" and not 0 < a["decay"] <= 1) or a["oversample"] < 1:
        ap.error(f"need --world >= 2, --steps/--every/--point >= 1, --decay in (0, 1] and --oversample >= 1, "
                 f"got {a}")
    a["progress"] = not ns.no_progress
    os.makedirs(ns.out, exist_ok=True)
    logger.info("drift benchmark: %s -> %s", {k: v for k, v in a.items() if k != "progress"}, ns.out)
    t = time.time()
    per_rank = spawn_ranks(_rank_main, a["world"], timeout=ns.timeout, pg_timeout_s=300, a=a)
    r = summarize([items[0] for items in per_rank], a)
    r["wall_s"] = round(time.time() - t, 1)
    r["allocator"] = per_rank[0][0]["allocator"]
    r["args"].pop("progress", None)
    with open(os.path.join(ns.out, "drift.json"), "w") as f:
        json.dump(r, f, indent=1)
    md = markdown(r)
    with open(os.path.join(ns.out, "drift.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    plot(r, os.path.join(ns.out, "drift.png"))
    for line in md[4:10]:
        logger.info("%s", line)
    logger.info("wrote drift.json, drift.md, drift.png to %s (%.0f s)", ns.out, r["wall_s"])
    return r


if __name__ == "__main__":
    main()
