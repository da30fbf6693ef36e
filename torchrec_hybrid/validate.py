"""Check the planner on the Criteo-like workload: estimated vs measured bytes, chosen vs optimal H.

Workload (docs/results.md, "How it is measured"): the 26 Criteo-Kaggle tables capped at ``--max-rows`` rows,
dim 64, local batch 1024, one id per feature, Zipf(alpha) ids over a fixed random
permutation of each table. Steps:

1. count statistics on ``--stats-batches`` batches (their own seed);
2. plan with ``HybridEmbeddingShardingPlanner`` on a uniform-bandwidth (gloo) topology, priced
   on bytes and collectives (``compute_costs=None``): this checks the byte model;
3. run the plan under DMP on W gloo ranks (torch.multiprocessing), warm up, then measure
   ``wchar`` (``torchrec_hybrid.comm_bytes``) over ``--steps`` steps with nothing printed or
   logged inside the window; compare with the cost model's bytes for the chosen plan;
4. compare each hybrid table's H with the brute-force optimum of the same cost model, on the
   counted statistics and on the exact Zipf probabilities.

Run: ``python -m torchrec_hybrid.validate [--world 4] [--json out.json]`` (installed:
``torchrec-hybrid-validate``).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints

from torchrec_hybrid.comm_bytes import count_sent_bytes
from torchrec_hybrid.planner import cost_model as cm
from torchrec_hybrid.planner.planner import HybridEmbeddingShardingPlanner
from torchrec_hybrid.planner.topology import gloo_topology
from torchrec_hybrid.sharder import HybridEmbeddingBagCollectionSharder
from torchrec_hybrid.spawn import spawn_ranks
from torchrec_hybrid.stats import FrequencyStats, criteo_table_sizes, criteo_tables
from torchrec_hybrid.stats.synthetic import ZipfSampler
from torchrec_hybrid.types import FREQUENCY_HYBRID

logger = logging.getLogger(__name__)


def _tables(max_rows: int, dim: int):
    return criteo_tables(criteo_table_sizes(max_rows=max_rows), embedding_dim=dim)


def _samplers(configs, alpha: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)  # the permutations: the same on every rank
    return [ZipfSampler(c.num_embeddings, alpha, g) for c in configs]


def _batch(configs, samplers, batch: int, g: torch.Generator):
    keys = [c.feature_names[0] for c in configs]
    values = torch.cat([s.sample(batch, g) for s in samplers])
    return torchrec.KeyedJaggedTensor(keys=keys, values=values,
                                      lengths=torch.ones(batch * len(keys), dtype=torch.int32), stride=batch)


def collect_stats(configs, samplers, batch: int, batches: int, seed: int = 12345):
    st = FrequencyStats(configs)
    g = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        st.update(_batch(configs, samplers, batch, g))
    return st


def make_plan(configs, stats, world: int, batch: int, bandwidth_gbps: float, kind: str = "planner"):
    """(planner or None, plan): the hybrid planner's plan, or every table ``kind`` (a control)."""
    cons = None if kind == "planner" else {c.name: ParameterConstraints(sharding_types=[kind]) for c in configs}
    # priced on bytes: the hot sets are then the byte model's optimum, which h_check brute-forces
    planner = HybridEmbeddingShardingPlanner(topology=gloo_topology(world, bandwidth_gbps), batch_size=batch,
                                             frequency_stats=stats, constraints=cons, compute_costs=None)
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = planner.plan(ebc, [HybridEmbeddingBagCollectionSharder(fused_params=_fused())])
    return planner, plan


def _fused() -> Dict[str, Any]:
    return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}


def estimated_bytes(planner, world: int) -> Dict[str, float]:
    """Cost-model bytes per rank per step of the planner's last plan, per table + overhead."""
    opts = planner.planned_options()
    out = {so.name: float(cm.option_mean_bytes(so, world) or 0.0) for so in opts}
    out["_module_overhead"] = sum(cm.module_overhead_bytes(world, types) for types in cm.sharding_groups(opts).values())
    return out


def _rank_main(rank: int, world: int, emit, plan, max_rows: int, dim: int, alpha: float, batch: int,
               warmup: int, steps: int) -> None:
    logging.disable(logging.CRITICAL)  # nothing may be written inside the measured window
    torch.set_num_threads(1)
    configs = _tables(max_rows, dim)
    samplers = _samplers(configs, alpha)
    model = DistributedModelParallel(
        torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        device=torch.device("cpu"), plan=plan,
        sharders=[HybridEmbeddingBagCollectionSharder(fused_params=_fused())])
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [_batch(configs, samplers, batch, g) for _ in range(warmup + steps)]

    def step(kjt):
        out = model(kjt).wait()
        out.values().sum().backward()

    for kjt in batches[:warmup]:
        step(kjt)
    dist.barrier()
    with count_sent_bytes() as sent:
        for kjt in batches[warmup:]:
            step(kjt)
    dist.barrier()
    emit(sent[0] / steps)


def measure(plan, world: int, max_rows: int, dim: int, alpha: float, batch: int, warmup: int, steps: int
            ) -> List[float]:
    """Bytes sent per step by each rank (``wchar``), running ``plan`` under DMP on gloo."""
    per_rank = spawn_ranks(_rank_main, world, timeout=1800, plan=plan, max_rows=max_rows, dim=dim,
                           alpha=alpha, batch=batch, warmup=warmup, steps=steps)
    return [items[0] for items in per_rank]


def h_check(planner, configs, stats, alpha: float, world: int, batch: int) -> List[Dict[str, Any]]:
    """Chosen H vs brute force of the cost model on the counts and on the exact Zipf law."""
    rows = []
    opts = {so.name: so for so in planner.planned_options()}
    for c in configs:
        ch = planner.hybrid_choices().get(c.name)
        if ch is None:
            continue
        tr = cm.TableTraffic(rows=c.num_embeddings, dim=c.embedding_dim, features=1, pooling=1.0,
                             batch=batch, world=world)
        cov = cm.coverage_from_counts(stats.counts(c.name).to(torch.float64))
        curve = cm.HYBRID.mean_bytes(tr, cov, torch.arange(cov.numel(), dtype=torch.float64))
        h_brute = int(torch.argmin(curve))
        w = torch.arange(1, c.num_embeddings + 1, dtype=torch.float64).pow(-alpha)
        true_cov = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(w / w.sum(), 0)])
        true_curve = cm.HYBRID.mean_bytes(tr, true_cov, torch.arange(true_cov.numel(), dtype=torch.float64))
        h_true = int(torch.argmin(true_curve))
        rows.append({
            "table": c.name, "rows": c.num_embeddings, "planned_type": opts[c.name].sharding_type,
            "h_chosen": ch.hot_rows, "h_brute_force": h_brute,
            "bytes_chosen": float(curve[ch.hot_rows]), "bytes_brute_force": float(curve[h_brute]),
            "h_true_optimum": h_true, "true_bytes_chosen": float(true_curve[ch.hot_rows]),
            "true_bytes_optimum": float(true_curve[h_true]),
        })
    return rows


def _count(least: int):
    """An argparse type: an int >= ``least`` (else argparse's error naming the flag and the value)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
        return value
    parse.__name__ = "count"  # what argparse's message calls the type
    return parse


def _stock_types() -> List[str]:
    """The stock sharding types the sharder plans on CPU (what --controls takes)."""
    return [t for t in HybridEmbeddingBagCollectionSharder().sharding_types("cpu") if t != FREQUENCY_HYBRID]


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=_count(1), default=4)
    ap.add_argument("--batch", type=_count(1), default=1024)
    ap.add_argument("--dim", type=_count(1), default=64)
    ap.add_argument("--max-rows", type=_count(1), default=100_000)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--stats-batches", type=_count(1), default=64)
    ap.add_argument("--warmup", type=_count(0), default=3)
    ap.add_argument("--steps", type=_count(1), default=5)
    ap.add_argument("--bandwidth-gbps", type=float, default=1.0)
    ap.add_argument("--controls", nargs="*", default=["table_wise"], choices=_stock_types(),
                    help="stock types to measure as well (every table that type)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _plan_entry(a: argparse.Namespace, configs, stats, kind: str) -> Dict[str, Any]:
    """One plan's estimated and measured bytes per rank (and, for the planner's, its H check)."""
    planner, plan = make_plan(configs, stats, a.world, a.batch, a.bandwidth_gbps, kind)
    est = estimated_bytes(planner, a.world)
    meas = measure(plan, a.world, a.max_rows, a.dim, a.alpha, a.batch, a.warmup, a.steps)
    types: Dict[str, int] = {}
    for so in planner.planned_options():
        types[so.sharding_type] = types.get(so.sharding_type, 0) + 1
    estimated, measured = sum(est.values()), sum(meas) / len(meas)
    entry: Dict[str, Any] = {"types": types, "estimated_bytes_per_rank_step": estimated,
                             "measured_bytes_per_rank_step": measured, "measured_per_rank": meas,
                             "estimated_per_table": est, "ratio_measured_to_estimated": measured / estimated}
    if kind == "planner":
        hc = h_check(planner, configs, stats, a.alpha, a.world, a.batch)
        entry["h_check"] = hc
        entry["total_hot_rows"] = sum(r["h_chosen"] for r in hc if r["planned_type"] == FREQUENCY_HYBRID)
    logger.info("%s: %s  estimated %.3f MB  measured %.3f MB per rank per step (x%.3f)", kind, types,
                estimated / 1e6, measured / 1e6, entry["ratio_measured_to_estimated"])
    return entry


def _log_h_check(hc: List[Dict[str, Any]]) -> None:
    same = sum(r["h_chosen"] == r["h_brute_force"] for r in hc)
    logger.info("H chosen == brute force of the cost model for %d/%d tables considered", same, len(hc))
    for r in hc:
        if r["planned_type"] == FREQUENCY_HYBRID:
            logger.info("  %-10s rows %7d  H %5d (brute %5d, exact-Zipf optimum %5d: %.0f vs %.0f B)", r["table"],
                        r["rows"], r["h_chosen"], r["h_brute_force"], r["h_true_optimum"],
                        r["true_bytes_chosen"], r["true_bytes_optimum"])


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    a = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    for name in ("torchrec", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    configs = _tables(a.max_rows, a.dim)
    stats = collect_stats(configs, _samplers(configs, a.alpha), a.batch, a.stats_batches)
    report: Dict[str, Any] = {"args": vars(a), "plans": {}}
    for kind in ["planner"] + list(a.controls):
        report["plans"][kind] = _plan_entry(a, configs, stats, kind)
    _log_h_check(report["plans"]["planner"]["h_check"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def cli() -> None:
    """The ``torchrec-hybrid-validate`` console script (exit status 0; the report is logged)."""
    main()


if __name__ == "__main__":
    main()
