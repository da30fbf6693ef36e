"""The DLRM example end to end: torchrun subprocesses on 2 gloo ranks (configs/dlrm_tiny.yaml)."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

from torchrec_hybrid.planner.topology import DEFAULT_GLOO_BW_GBPS, gbps_to_bytes_per_ms
from torchrec_hybrid.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TRAIN = os.path.join(REPO, "examples", "dlrm", "train.py")
TINY = os.path.join(REPO, "configs", "dlrm_tiny.yaml")
KEYS = ("step", "loss", "auc", "samples_per_s", "bytes_per_step")


def _cmd(args, nproc: int = 2) -> List[str]:
    return [TORCHRUN, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), TRAIN, "--config", TINY, *args]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def run_train(*args: str, timeout: float = 120, nproc: int = 2) -> Tuple[Dict, str]:
    """Runs train.py under torchrun; returns (the final JSON line, stderr)."""
    proc = subprocess.run(_cmd(args, nproc), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one stdout line, got {lines!r}"
    return json.loads(lines[0]), proc.stderr


def read_losses(path) -> List[Tuple[int, float]]:
    with open(path) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def test_smoke_two_ranks(tmp_path):
    out, err = run_train("--steps", "6", "--set", "train.log_level=info", "--set", f"train.profile_dir={tmp_path}",
                         "--set", "train.profile_after=2", "--set", "train.profile_steps=2")
    for k in KEYS + ("ne", "val_auc", "val_ne", "val_loss"):
        assert k in out, f"missing {k} in {out}"
        assert out[k] is not None and math.isfinite(out[k]), f"{k} = {out[k]}"
    assert out["step"] == 6 and out["status"] == "completed"
    assert out["world_size"] == 2 and out["hot_rows"] > 0
    assert out["bytes_per_step"] > 0 and out["samples_per_s"] > 0
    # the planner's table is visible at info level: per table type / ranks / hot rows / coverage,
    # per rank memory and modelled bytes
    assert "plan: table" in err and "frequency_hybrid" in err and "hot cover" in err
    assert "plan: rank 1:" in err and "modelled" in err and "plan candidates" in err
    # sharding.network: topology (the tiny config's): gloo_topology's bandwidth, nothing measured, and the
    # one line saying which plan is trained names where that bandwidth came from
    assert out["network"] == {"setting": "topology", "used": True} and "network (gloo" not in err
    assert out["planned_bandwidth"] == pytest.approx(gbps_to_bytes_per_ms(DEFAULT_GLOO_BW_GBPS))
    assert f"plan: {out['plan_summary']}" in err and "[network the topology's own: " in out["plan_summary"]
    # a chrome trace per rank of steps 3-4, with the hybrid's asynchronous output all-to-all in it
    for r in (0, 1):
        with open(tmp_path / f"trace_rank{r}.json") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert {"## step 2 ##", "## step 3 ##", "_AllToAllRequest", "_AllToAllWait"} <= names
        assert "## step 4 ##" not in names


def test_multi_hot_mean_pooling():
    out, _ = run_train("--steps", "4", "--set", "data.multi_hot=true", "--set", "model.pooling=mean")
    assert all(math.isfinite(out[k]) for k in KEYS) and out["loss"] < 2.0


N = 8  # steps of the resume tests; the first run stops at N // 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted runs under each planner and the first halves (checkpoints) under each.

    The uninterrupted runs also validate every 3 steps (which must not change training);
    the others do not.
    """
    root = tmp_path_factory.mktemp("dlrm_runs")
    out = {}
    for planner in ("hybrid", "stock"):
        full = root / f"full_{planner}.jsonl"
        run_train("--steps", str(N), "--planner", planner, "--set", f"metrics.jsonl={full}",
                  "--set", "metrics.validation_every=3")
        ckpt, part = root / f"ckpt_{planner}", root / f"part_{planner}.jsonl"
        first, _ = run_train("--steps", str(N // 2), "--planner", planner, "--checkpoint-dir", str(ckpt),
                             "--set", f"metrics.jsonl={part}", "--set", "metrics.validation_batches=0")
        assert first["step"] == N // 2
        assert (ckpt / f"step_{N // 2}" / ".metadata").exists()
        out[planner] = {"full": read_losses(full), "ckpt": ckpt, "part": part}
    return out


@pytest.mark.parametrize("before, after", [("hybrid", "hybrid"), ("hybrid", "stock"), ("stock", "hybrid")])
def test_resume_under_any_plan(runs, tmp_path, before, after):
    """A checkpoint of one plan resumes under another, optimizer state included: the losses
    equal those of an uninterrupted run under the new plan (same plan: bit for bit)."""
    ckpt, part = tmp_path / "ckpt", tmp_path / "part.jsonl"
    shutil.copytree(runs[before]["ckpt"], ckpt)
    shutil.copy(runs[before]["part"], part)
    out, err = run_train("--steps", str(N), "--planner", after, "--checkpoint-dir", str(ckpt), "--resume",
                         "--set", f"metrics.jsonl={part}", "--set", "train.log_level=warning")
    assert out["start_step"] == N // 2 and out["step"] == N and out["planner"] == after
    assert "WARNING" not in err, err[-3000:]  # every state mapped
    full, resumed = runs[after]["full"], read_losses(part)
    assert [s for s, _ in resumed] == list(range(1, N + 1))
    if before == after:
        assert resumed == full, f"uninterrupted {full}\nresumed       {resumed}"
    else:
        for (step, a), (_, b) in zip(full[N // 2:], resumed[N // 2:]):
            assert b == pytest.approx(a, rel=1e-3), f"step {step}: uninterrupted {a}, resumed {b}"


def test_resume_of_finished_run_says_so(runs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["hybrid"]["ckpt"], ckpt)
    out, err = run_train("--steps", str(N // 2), "--checkpoint-dir", str(ckpt), "--resume",
                         "--set", "train.log_level=warning")
    assert out["status"] == "already_finished" and out["step"] == N // 2
    assert "nothing to do" in err


def test_unmappable_optimizer_state_warns_and_continues(runs, tmp_path):
    # sgd has no state: the checkpoint's rowwise accumulators cannot be used -> a warning
    # naming the tables, never a crash; and from sgd to rowwise_adagrad the tables are named too
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["stock"]["ckpt"], ckpt)
    out, err = run_train("--steps", str(N // 2 + 1), "--checkpoint-dir", str(ckpt), "--resume",
                         "--set", "optim.embedding.optimizer=adagrad", "--set", "train.log_level=warning")
    assert out["step"] == N // 2 + 1
    assert "not loaded" in err and "t_cat_" in err


def test_short_run_keep_last_and_no_nan(tmp_path):
    # a run shorter than its warm-up still reports samples/s; keep_last keeps the newest 2
    ckpt = tmp_path / "ckpt"
    out, _ = run_train("--steps", "6", "--checkpoint-dir", str(ckpt), "--set", "checkpoint.every=2",
                       "--set", "checkpoint.keep_last=2", "--set", "metrics.warmup_steps=100",
                       "--set", "metrics.validation_batches=0")
    assert out["samples_per_s"] is not None and out["samples_per_s"] > 0 and out["timed_steps"] == 6
    assert sorted(os.listdir(ckpt)) == ["stats.pt", "step_4", "step_6"]


def test_sigterm_stops_every_rank_with_a_checkpoint(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    proc = subprocess.Popen(_cmd(["--steps", "100000", "--checkpoint-dir", str(ckpt), "--set",
                                  f"metrics.jsonl={log}", "--set", "train.log_level=warning"]),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: the workers go down with it below
    try:
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # torchrun and its workers (which hold the pipes), then a bounded wait
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert "SIGTERM: every rank stops at step" in stderr, stderr[-3000:]
    assert "]: Traceback" not in stderr, stderr[-3000:]  # no rank failed (torchrun itself reports the signal)
    lines = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines and lines[0]["status"] == "stopped by SIGTERM"
    step = lines[0]["step"]
    assert (ckpt / f"step_{step}" / ".metadata").exists() and step >= 3


def test_auc_rises_on_synthetic_data():
    # progressive validation: the last 40 steps' predictions were made before training on them
    out, _ = run_train("--steps", "120", "--batch-size", "256", "--set", "metrics.window=40",
                       "--set", "metrics.validation_batches=8", timeout=150)
    assert out["auc"] > 0.6 and out["val_auc"] > 0.6 and out["val_ne"] < 1.0, out


@pytest.mark.parametrize("flag, words", [
    ("--set train.stepz=3", ["train.stepz", "allowed", "steps"]),
    ("--set data.batch_size", ["not key=value"]),
    ("--set train.steps=abc", ["train.steps", "integer", "'abc'"]),
    ("--set sharding.planner=fast", ["sharding.planner", "'hybrid'", "'stock'"]),
    ("--set sharding.network=fast", ["sharding.network", "'measure'", "'topology'", "'fast'"]),
    ("--set sharding.hot_set.budget=1", ["sharding.hot_set", "budget_mb"]),
    ("--set sharding.tables={t_cat_0: {sharding_types: [hybrid]}}", ["sharding.tables.t_cat_0.sharding_types"]),
    ("--set model.dense_arch=[32,8]", ["model.dense_arch", "embedding_dim"]),
])
def test_bad_override_is_rejected(flag, words):
    from examples.dlrm.config import config_from_args

    with pytest.raises(ValueError) as e:
        config_from_args(["--config", TINY, *flag.split(" ", 1)])
    for w in words:
        assert w in str(e.value), (w, str(e.value))
