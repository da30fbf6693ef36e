"""How much of a step its collectives are: each plan's own collectives replayed alone.

The hybrid saves bytes; on these CPU boxes a byte over loopback is a memory copy, so what the
saving can buy is bounded by what the stock plan's collectives cost. This benchmark measures
that bound. Per workload, in one gloo process group, the product's plans (``benchmarks/product.py``:
same tables, statistics and batches) each record the collectives of one training step after a first,
untimed, one (which sets up what later steps reuse) - every ``c10d::`` op the dispatcher runs, forward
and backward, with its split sizes - and then, step by
step in a Williams order behind a barrier, each plan trains one step and each plan's recorded
collectives run once more on their own (fresh buffers of the same sizes, same process group, each
waited for in turn). Per plan: the slowest rank's step ``S``, the slowest rank's replay ``C`` (its
collectives with nothing else running), and their difference, the step's compute and waiting.

What a plan could gain from bytes alone is ``C_stock - C_plan``: a plan with the stock plan's
compute and this plan's collectives steps in ``(S_stock - C_stock + C_plan) / S_stock`` of the stock
step (the "bytes-only bound"). The bytes the replay sends (``wchar``) must be within 10% of the step's
(else the run raises): the replay is the step's communication. Collectives that overlap compute in a
real step cost less there than alone; the bound counts them in full, which favours the plan with fewer bytes.

    python -m benchmarks.comm_floor                            # W=4, onehot and multihot, 3 runs, ~2 min
    python -m benchmarks.comm_floor --out benchmarks/results   # the committed run
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from benchmarks import malloc
from benchmarks.spawner import spawn_ranks
from benchmarks.measure import balanced_orders, ci_text, median_ci, slowest_rank
from benchmarks.workloads import MODELS, WORKLOADS, plan_models, plan_types, types_text, workload_data
from benchmarks.report import write_results

logger = logging.getLogger(__name__)

_NOT_REPLAYED = {"c10d::barrier"}
REPLAY_BYTES_TOLERANCE = 0.1  # the replay's bytes against the steps' (the ids, so the sizes, differ per batch)


def _fresh(x: Any) -> Any:
    """``x`` with every tensor in it (lists too) replaced by a new one of its size, dtype and device."""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_fresh(v) for v in x)
    return x


def _wait_all(result: Any) -> None:
    """Waits for every c10d ``Work`` in an op's result (a Work, or a tuple holding one)."""
    for r in result if isinstance(result, (list, tuple)) else [result]:
        if hasattr(r, "wait") and not isinstance(r, torch.Tensor):
            r.wait()


class CollectiveRecorder:
    """While active, records every collective the dispatcher runs (forward and backward alike) with
    fresh buffers of its sizes; :meth:`replay` runs them again, in order, each waited for."""

    def __init__(self) -> None:
        self.calls: List[Tuple[Any, tuple, dict]] = []

    def __enter__(self) -> "CollectiveRecorder":
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.name().split(".")[0]
                if name.startswith("c10d::") and name not in _NOT_REPLAYED:
                    recorder.calls.append((func, _fresh(args), _fresh(kwargs)))
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def names(self) -> List[str]:
        return [func.name().split(".")[0] for func, _, _ in self.calls]

    def replay(self) -> None:
        for func, args, kwargs in self.calls:
            _wait_all(func(*args, **kwargs))

    def replay_each(self) -> List[float]:
        """Each collective run again on its own, behind a barrier: its wall seconds, in recorded order."""
        import torch.distributed as dist

        times = []
        for func, args, kwargs in self.calls:
            dist.barrier()
            t0 = time.perf_counter()
            _wait_all(func(*args, **kwargs))
            times.append(time.perf_counter() - t0)
        return times

    def sizes(self) -> List[int]:
        """Bytes of each recorded collective's largest buffer argument (an all-to-all's input or output; a list
        of tensors counts as one buffer)."""
        def nbytes(x: Any) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(nbytes(v) for v in x) if isinstance(x, (list, tuple)) else 0
        return [max([nbytes(a) for a in args] + [0]) for _, args, _ in self.calls]


def _timed(fn: Callable[[], None]) -> Tuple[float, int]:
    """``fn()`` behind a barrier: its wall seconds and the bytes this rank sent meanwhile."""
    import torch.distributed as dist

    from torchrec_hybrid.comm_bytes import sent_bytes

    dist.barrier()
    b0, t0 = sent_bytes(), time.perf_counter()
    fn()
    t1, b1 = time.perf_counter(), sent_bytes()
    return t1 - t0, b1 - b0


def _rank_main(rank: int, world: int, emit, workload: str, rows_cap: int, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from benchmarks.models import training_loss

    spec = WORKLOADS[workload]
    tables, stats, batches = workload_data(spec, world, rank, rows_cap, 8, 2 + warmup + steps)
    _, plans, models = plan_models(tables, stats, spec, world, dist.GroupMember.WORLD)
    logging.disable(logging.CRITICAL)  # nothing may be written inside a measured window

    def step(name: str, kjt: Any) -> Callable[[], None]:
        return lambda: training_loss(models[name](kjt).wait().values()).backward()

    recorders = {}
    for name in MODELS:  # a first step per plan (it sets up what later steps reuse), then one recorded
        dist.barrier()
        step(name, batches[0])()
        dist.barrier()
        with CollectiveRecorder() as recorders[name]:
            step(name, batches[1])()
    items = [(kind, name) for name in MODELS for kind in ("step", "collectives")]
    orders = balanced_orders(len(items))
    wall: Dict[str, List[float]] = {f"{k}:{n}": [] for k, n in items}
    sent: Dict[str, List[int]] = {f"{k}:{n}": [] for k, n in items}
    for i, kjt in enumerate(batches[2:]):
        for kind, name in (items[j] for j in orders[(i - warmup) % len(orders)]):  # balanced over the timed steps
            fn = step(name, kjt) if kind == "step" else recorders[name].replay
            t, b = _timed(fn)
            if i >= warmup:
                wall[f"{kind}:{name}"].append(t)
                sent[f"{kind}:{name}"].append(b)
    each: Dict[str, List[List[float]]] = {n: [] for n in MODELS}
    for i in range(steps):  # each collective alone, per plan
        for name in MODELS:
            each[name].append(recorders[name].replay_each())
    emit({"wall": wall, "each": each, "sizes": {n: recorders[n].sizes() for n in MODELS},
          "sent": {k: statistics.fmean(v) for k, v in sent.items()},
          "collectives": {n: recorders[n].names() for n in MODELS}, "allocator": malloc.current(),
          "types": {n: plan_types(plans[n]) for n in MODELS}})


def run(workload: str, world: int, rows_cap: int, warmup: int, steps: int, repeats: int = 1) -> Dict[str, Any]:
    """One workload, ``repeats`` runs in fresh processes pooled: per plan, the slowest rank's step and replayed
    collectives (median over every run's steps), the bytes each sent per rank (busiest rank of the runs' mean),
    each collective alone, and the bytes-only bound against the stock planner's plan."""
    runs = [[items[0] for items in spawn_ranks(_rank_main, world, timeout=3000, workload=workload,
                                                       rows_cap=rows_cap, warmup=warmup, steps=steps)]
            for _ in range(repeats)]
    first = runs[0][0]
    per: Dict[str, Any] = {}
    for name in MODELS:
        if any(run[0]["collectives"][name] != first["collectives"][name] for run in runs):
            raise RuntimeError(f"{workload}: {name} issued other collectives in another run")

        def pooled(kind: str) -> List[float]:
            return [t for run in runs for t in slowest_rank([o["wall"][f"{kind}:{name}"] for o in run])]

        def busiest(kind: str) -> float:
            return max(statistics.fmean(run[r]["sent"][f"{kind}:{name}"] for run in runs) for r in range(world))

        n = len(first["collectives"][name])
        # per collective alone, per repeat of every run: the slowest rank's time
        alone = [[max(o["each"][name][rep][k] for o in run) for run in runs for rep in range(len(run[0]["each"][name]))]
                 for k in range(n)]
        s, c = pooled("step"), pooled("collectives")
        per[name] = {"types": first["types"][name], "collectives": first["collectives"][name],
                     "step_s": s, "collectives_s": c,
                     "median_step_s": statistics.median(s), "median_collectives_s": statistics.median(c),
                     "step_bytes_busiest": busiest("step"), "collectives_bytes_busiest": busiest("collectives"),
                     # per collective, in issue order: the slowest rank's time alone (median over repeats) and
                     # the largest buffer over ranks
                     "each_s": [statistics.median(ts) for ts in alone],
                     "each_buffer_bytes": [max(o["sizes"][name][k] for o in runs[0]) for k in range(n)]}
        replayed, stepped = per[name]["collectives_bytes_busiest"], per[name]["step_bytes_busiest"]
        if abs(replayed / stepped - 1) > REPLAY_BYTES_TOLERANCE:
            raise RuntimeError(f"{workload}: {name}'s replayed collectives sent {replayed:.0f} bytes on the busiest "
                               f"rank, its steps {stepped:.0f}: the replay is not the step's communication")
    stock = per["stock_planner"]
    for name in MODELS:
        p = per[name]
        p["collectives_share"] = p["median_collectives_s"] / p["median_step_s"]
        # per step: this plan's replay, with the stock step's compute (its step less its replay), over the stock step
        bound = [(ss - cs + cp) / ss for ss, cs, cp in zip(stock["step_s"], stock["collectives_s"], p["collectives_s"])]
        p["bytes_only_bound"] = median_ci(bound)
        p["step_ratio"] = median_ci([a / b for a, b in zip(p["step_s"], stock["step_s"])])
        p["compute_excess_s"] = statistics.median(
            [(sp - cp) - (ss - cs) for sp, cp, ss, cs in zip(p["step_s"], p["collectives_s"], stock["step_s"],
                                                              stock["collectives_s"])])
    return {"workload": workload, "world": world, "batch": WORKLOADS[workload]["batch"], "rows_cap": rows_cap,
            "steps": steps, "repeats": repeats, "allocator": first["allocator"], "plans": per}


def markdown(results: List[Dict[str, Any]]) -> List[str]:
    r0 = results[0]
    runs = r0.get("repeats", 1)
    lines = [f"# Collectives' share of a step: W={r0['world']}, {runs} x {r0['steps']} interleaved steps", "",
             "Per plan, the slowest rank's median training step and the slowest rank's median replay of the "
             "plan's own collectives alone (same sizes and process group; `benchmarks/comm_floor.py`), the "
             "busiest rank's bytes in each, and the bytes-only bound: the stock planner's step with its "
             f"collectives swapped for this plan's, over the stock step. Allocator: {malloc.described(results)}.",
             "",
             "| workload | plan | its types | collectives per step | step ms | collectives alone ms | share | "
             "MB busiest rank: step / replay | step vs stock | bytes-only bound | compute + waiting vs stock, ms |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for name, p in r["plans"].items():
            types = types_text(p["types"])
            lines.append(
                f"| {r['workload']} B={r['batch']} | {name} | {types} | {len(p['collectives'])} | "
                f"{p['median_step_s'] * 1e3:.1f} | {p['median_collectives_s'] * 1e3:.1f} | "
                f"{p['collectives_share']:.0%} | {p['step_bytes_busiest'] / 1e6:.2f} / "
                f"{p['collectives_bytes_busiest'] / 1e6:.2f} | {ci_text(p['step_ratio'])} | "
                f"{ci_text(p['bytes_only_bound'])} | "
                f"{p['compute_excess_s'] * 1e3:+.1f} |")
    lines += ["", "Each collective alone, in the order a step issues it (forward, then backward): the slowest rank's "
              "time behind a barrier, median over repeats, ms (its largest buffer over ranks, kB):", "",
              "| workload | plan | collectives |", "|---|---|---|"]
    for r in results:
        for name, p in r["plans"].items():
            cells = ", ".join(f"{t * 1e3:.1f} ({b / 1e3:.0f})" for t, b in zip(p["each_s"], p["each_buffer_bytes"]))
            lines.append(f"| {r['workload']} B={r['batch']} | {name} | {cells} |")
    return lines


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["onehot", "multihot"], choices=list(WORKLOADS))
    ap.add_argument("--rows-cap", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="runs in fresh processes, their steps pooled")
    ap.add_argument("--out", default="out/comm_floor")
    a = ap.parse_args(argv)
    if a.world < 2 or a.steps < 1 or a.warmup < 0 or a.repeats < 1:
        ap.error(f"--world must be >= 2, --steps >= 1, --warmup >= 0 and --repeats >= 1 (got {a.world}, {a.steps}, "
                 f"{a.warmup}, {a.repeats})")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    results = []
    for w in a.workloads:
        logger.info("comm_floor: %s, W=%d", w, a.world)
        results.append(run(w, a.world, a.rows_cap, a.warmup, a.steps, a.repeats))
    print(write_results(a.out, "comm_floor", results, markdown(results)))
    return results


if __name__ == "__main__":
    main()
