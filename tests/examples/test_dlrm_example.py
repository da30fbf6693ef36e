"""The DLRM example end to end: torchrun subprocesses on 2 gloo ranks (configs/dlrm_tiny.yaml)."""

import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

from torchrec_hybrid.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TRAIN = os.path.join(REPO, "examples", "dlrm", "train.py")
TINY = os.path.join(REPO, "configs", "dlrm_tiny.yaml")
KEYS = ("step", "loss", "auc", "samples_per_s", "bytes_per_step")


def run_train(*args: str, timeout: float = 120, nproc: int = 2) -> Tuple[Dict, str]:
    """Runs train.py under torchrun; returns (the final JSON line, stderr)."""
    cmd = [TORCHRUN, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), TRAIN, "--config", TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one stdout line, got {lines!r}"
    return json.loads(lines[0]), proc.stderr


def read_losses(path: str) -> List[Tuple[int, float]]:
    with open(path) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def test_smoke_two_ranks():
    out, _ = run_train("--steps", "6")
    for k in KEYS:
        assert k in out, f"missing {k} in {out}"
        assert math.isfinite(out[k]), f"{k} = {out[k]}"
    assert out["step"] == 6
    assert out["world_size"] == 2 and out["hot_rows"] > 0
    assert out["bytes_per_step"] > 0 and out["samples_per_s"] > 0


def test_multi_hot_mean_pooling():
    out, _ = run_train("--steps", "4", "--set", "data.multi_hot=true", "--set", "model.pooling=mean")
    assert all(math.isfinite(out[k]) for k in KEYS) and out["loss"] < 2.0


def test_stock_planner_runs_same_config():
    out, _ = run_train("--steps", "4", "--planner", "stock")
    assert out["planner"] == "stock" and out["hot_rows"] == 0
    assert all(math.isfinite(out[k]) for k in KEYS)


def test_resume_gives_same_losses(tmp_path):
    n = 8
    full = tmp_path / "full.jsonl"
    run_train("--steps", str(n), "--set", f"metrics.jsonl={full}")
    ckpt, part = tmp_path / "ckpt", tmp_path / "part.jsonl"
    first, _ = run_train("--steps", str(n // 2), "--checkpoint-dir", str(ckpt), "--set", f"metrics.jsonl={part}")
    assert first["step"] == n // 2
    assert (ckpt / f"step_{n // 2}" / ".metadata").exists()
    second, _ = run_train("--steps", str(n), "--checkpoint-dir", str(ckpt), "--resume",
                          "--set", f"metrics.jsonl={part}")
    assert second["start_step"] == n // 2 and second["step"] == n
    a, b = read_losses(full), read_losses(part)
    assert [s for s, _ in a] == list(range(1, n + 1))
    assert a == b, f"uninterrupted {a}\nresumed       {b}"


def test_auc_rises_on_synthetic_data():
    # progressive validation: the last 40 steps' predictions were made before training on them
    out, _ = run_train("--steps", "120", "--batch-size", "256", "--set", "metrics.auc_window=40", timeout=150)
    assert out["auc"] > 0.6, out


@pytest.mark.parametrize("flag", ["--set train.stepz=3", "--set data.batch_size"])
def test_bad_override_is_rejected(flag):
    from examples.dlrm.config import config_from_args

    with pytest.raises((KeyError, ValueError)):
        config_from_args(["--config", TINY, *flag.split(" ", 1)])


def test_checkpoint_weights_load_into_stock_plan(tmp_path):
    # hybrid run of 4 steps + checkpoint; the 5th loss only depends on the weights and batch 5,
    # so a stock-planned run that loads those weights must reproduce it.
    ckpt, hyb, stock = tmp_path / "ckpt", tmp_path / "hybrid.jsonl", tmp_path / "stock.jsonl"
    run_train("--steps", "5", "--set", f"metrics.jsonl={hyb}")
    run_train("--steps", "4", "--checkpoint-dir", str(ckpt))
    out, _ = run_train("--steps", "5", "--checkpoint-dir", str(ckpt), "--resume", "--planner", "stock",
                       "--set", "checkpoint.load_optimizer=false", "--set", f"metrics.jsonl={stock}")
    assert out["planner"] == "stock" and out["start_step"] == 4
    (step_h, loss_h), (step_s, loss_s) = read_losses(hyb)[-1], read_losses(stock)[-1]
    assert step_h == step_s == 5
    assert loss_s == pytest.approx(loss_h, rel=1e-5)
