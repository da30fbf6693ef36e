"""Soak (issue 58 item 4): a long DLRM example run with hot-set refreshes and checkpoints, watched from
outside, and the same run resumed from its mid-way checkpoint.

    python -m benchmarks.soak                     # 20,000 steps, refresh every 25, checkpoint every 1,000
    python -m benchmarks.soak --steps 2000        # a shorter one

Run A trains ``--steps`` steps of the tiny config on 2 ranks under torchrun (refresh every
``--refresh-every`` steps, statistics in the checkpoints, a checkpoint every ``--checkpoint-every``).
While it runs, every ``--sample-s`` seconds each worker's RSS and open file descriptors are read
from ``/proc`` and the step it is at from the per-step log. Run B resumes from A's checkpoint at
half way and trains to the end. Reported: RSS, descriptors and the time per step over the first and
the last ``--window`` steps (and their ratio: flat within 5% is the issue's bar), the time per step of
every window and the trend of a line through them (single windows swing with the machine's other
load), both runs' exit
codes, whether B's per-step losses equal A's and whether the final checkpoints' weights and
optimizer state are equal, bit for bit (each converted with ``dcp_to_torch_save``; the largest
difference is reported too). Writes ``--out`` (JSON).
"""

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from torchrec_hybrid.spawn import free_port

logger = logging.getLogger("benchmarks.soak")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TRAIN = os.path.join(REPO, "examples", "dlrm", "train.py")
TINY = os.path.join(REPO, "configs", "dlrm_tiny.yaml")


def _workers(launcher: int) -> List[int]:
    pids: List[int] = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        try:
            with open(f"/proc/{launcher}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _probe(pid: int) -> Optional[Dict[str, int]]:
    """A worker's resident memory (bytes) and open descriptors; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
        return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, StopIteration):
        return None


def _steps_logged(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def run(args: List[str], log: str, sample_s: float, timeout_s: float) -> Dict[str, Any]:
    """One torchrun of the example; samples ``(time, steps logged, per-worker rss / fds)`` while it runs."""
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           TRAIN, "--config", TINY, "--set", f"metrics.jsonl={log}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    samples: List[Dict[str, Any]] = []
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        while proc.poll() is None and time.time() - t0 < timeout_s:
            time.sleep(sample_s)
            probes = [p for p in map(_probe, _workers(proc.pid)) if p is not None]
            if len(probes) == 2:
                samples.append({"t": time.time() - t0, "step": _steps_logged(log), "rss": [p["rss"] for p in probes],
                                "fds": [p["fds"] for p in probes]})
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
        err.seek(0)
        stderr = err.read()
    final = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    return {"exit": proc.returncode, "final": final[-1] if final else None, "samples": samples,
            "wall_s": time.time() - t0, "stderr_tail": stderr[-3000:]}


def _at(samples: List[Dict[str, Any]], step: int) -> Optional[Dict[str, Any]]:
    """The first sample at or past ``step``."""
    return next((s for s in samples if s["step"] >= step), None)


def window(samples: List[Dict[str, Any]], lo: int, hi: int) -> Dict[str, Any]:
    """Seconds per step between the samples at steps ``lo`` and ``hi`` (sample times, so within a sample
    interval), and the mean RSS (MB, per worker) and descriptors over the samples in between."""
    a, b = _at(samples, lo), _at(samples, hi)
    inside = [s for s in samples if lo <= s["step"] <= hi] or [x for x in (a, b) if x]
    if a is None or b is None or b["step"] == a["step"]:
        return {"steps": (lo, hi), "s_per_step": None}
    return {"steps": (lo, hi), "s_per_step": (b["t"] - a["t"]) / (b["step"] - a["step"]),
            "rss_mb": statistics.fmean(statistics.fmean(s["rss"]) for s in inside) / 1e6,
            "fds": statistics.fmean(statistics.fmean(s["fds"]) for s in inside)}


def _trend(values: List[float]) -> Optional[float]:
    """The least-squares line through the windows' times per step: its change over 10 windows (10,000 steps at
    the default window) relative to the mean (single windows swing with the machine's other load)."""
    n = len(values)
    if n < 3:
        return None
    mx, my = (n - 1) / 2, statistics.fmean(values)
    slope = sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))
    return 10 * slope / my


def _losses(path: str) -> Dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _flat(directory: str) -> Dict[str, torch.Tensor]:
    """A DCP checkpoint's tensors, by flattened key (one process, no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        dcp_to_torch_save(directory, path)
        state = torch.load(path, weights_only=False)
    out: Dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, torch.Tensor):
            out[prefix[:-1]] = v

    walk("", state)
    return out


def compare_checkpoints(a: str, b: str, tol: float) -> Dict[str, Any]:
    """Two checkpoints' tensors: how many are bit-equal, the largest difference relative to the tensor's
    largest value, and whether all are within ``tol`` of it."""
    x, y = _flat(a), _flat(b)
    common = sorted(set(x) & set(y))
    rel = {k: float((x[k].double() - y[k].double()).abs().max() / x[k].double().abs().max().clamp(min=1e-30))
           for k in common if x[k].numel() and x[k].is_floating_point()}
    worst = max(rel, key=rel.get) if rel else None
    return {"tensors": len(x), "same_keys": sorted(x) == sorted(y),
            "bit_equal": sum(torch.equal(x[k], y[k]) for k in common),
            "max_relative_difference": rel.get(worst, 0.0) if worst else 0.0, "worst": worst,
            "equal_within_tolerance": sorted(x) == sorted(y) and all(v <= tol for v in rel.values()), "tol": tol}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--refresh-every", type=int, default=25)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--window", type=int, default=1000, help="steps compared at the start and the end")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--tol", type=float, default=1e-3, help="largest difference of the two final checkpoints' "
                    "tensors, relative to the tensor's largest value")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--work", default=os.path.join("out", "soak"), help="checkpoints and logs (emptied first)")
    ap.add_argument("--out", default=os.path.join("out", "soak.json"))
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    if ns.steps % ns.checkpoint_every or (ns.steps // 2) % ns.checkpoint_every:
        ap.error("--steps and --steps / 2 must be multiples of --checkpoint-every")
    shutil.rmtree(ns.work, ignore_errors=True)
    os.makedirs(ns.work)
    common = ["--steps", str(ns.steps), "--set", f"sharding.refresh.every={ns.refresh_every}",
              "--set", "checkpoint.stats=true", "--set", f"checkpoint.every={ns.checkpoint_every}",
              "--set", "metrics.validation_batches=0", "--set", "train.log_level=warning",
              "--set", "data.drift_rows=1.0"]
    full_dir, full_log = os.path.join(ns.work, "full"), os.path.join(ns.work, "full.jsonl")
    logger.info("run A: %d steps (refresh every %d, checkpoint every %d)", ns.steps, ns.refresh_every,
                ns.checkpoint_every)
    a = run([*common, "--checkpoint-dir", full_dir], full_log, ns.sample_s, ns.timeout)
    logger.info("run A: exit %s after %.0f s", a["exit"], a["wall_s"])
    half = ns.steps // 2
    part_dir, part_log = os.path.join(ns.work, "resumed"), os.path.join(ns.work, "resumed.jsonl")
    os.makedirs(part_dir)
    shutil.copytree(os.path.join(full_dir, f"step_{half}"), os.path.join(part_dir, f"step_{half}"))
    with open(full_log) as src, open(part_log, "w") as dst:  # the log as it was at the checkpoint
        dst.writelines(ln for ln in src if json.loads(ln)["step"] <= half)
    logger.info("run B: resumed at step %d", half)
    b = run([*common, "--checkpoint-dir", part_dir, "--resume"], part_log, ns.sample_s, ns.timeout)
    logger.info("run B: exit %s after %.0f s", b["exit"], b["wall_s"])
    w = ns.window
    first, last = window(a["samples"], w, 2 * w), window(a["samples"], ns.steps - w, ns.steps)
    per_window = [window(a["samples"], lo, lo + w)["s_per_step"] for lo in range(0, ns.steps - w + 1, w)]
    trend = _trend([v for v in per_window if v is not None])
    la, lb = _losses(full_log), _losses(part_log)
    after = range(half + 1, ns.steps + 1)
    result = {
        "args": vars(ns), "exit": {"full": a["exit"], "resumed": b["exit"]},
        "first": first, "last": last,
        "step_time_last_over_first": (last["s_per_step"] / first["s_per_step"]
                                      if first["s_per_step"] and last["s_per_step"] else None),
        "ms_per_step_by_window": [None if v is None else round(v * 1e3, 2) for v in per_window],
        "step_time_trend_per_10k_steps": trend,
        "rss_last_over_first": last.get("rss_mb", 0) / first["rss_mb"] if first.get("rss_mb") else None,
        "fds_first_last": (first.get("fds"), last.get("fds")),
        "max_rss_mb": max((max(s["rss"]) for s in a["samples"]), default=0) / 1e6,
        "refreshes": (a["final"] or {}).get("refreshes"),
        "losses_equal_after_resume": all(lb.get(s) == la.get(s) for s in after),
        "checkpoints": compare_checkpoints(os.path.join(full_dir, f"step_{ns.steps}"),
                                           os.path.join(part_dir, f"step_{ns.steps}"), ns.tol),
        "loss_max_relative_difference": max((abs(lb[s] - la[s]) / abs(la[s]) for s in after if s in la and s in lb
                                             and la[s]), default=None),
        "wall_s": {"full": a["wall_s"], "resumed": b["wall_s"]},
        "samples": a["samples"][:: max(1, len(a["samples"]) // 400)],
        "stderr_tail": {"full": a["stderr_tail"], "resumed": b["stderr_tail"]},
    }
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    logger.info("step time last/first %s (trend %s per 10 windows), RSS last/first %s, fds %s, losses equal %s, "
                "checkpoints equal %s -> %s", result["step_time_last_over_first"],
                result["step_time_trend_per_10k_steps"], result["rss_last_over_first"], result["fds_first_last"],
                result["losses_equal_after_resume"], result["checkpoints"]["equal_within_tolerance"], ns.out)
    return result


if __name__ == "__main__":
    main()
