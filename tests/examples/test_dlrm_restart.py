"""Elastic restarts of the DLRM example (issue 20, items 7 and 8): a worker SIGKILLed mid-run
under ``torchrun --max-restarts 1`` with ``checkpoint.resume=auto`` is restarted, resumes from
the last checkpoint and ends with the uninterrupted run's loss, validation loss and weights
(``weights_sha256``). Before the fix the restarted workers read the attempt before's gloo
addresses from torchrun's store (it outlives a restart) and failed in ``connectFullMesh`` or
hung. Every wait is bounded; leftovers are killed."""

import json
import os
import signal
import subprocess
import time
from datetime import timedelta

import torch.distributed as dist

from test_dlrm_faults import ENV, REPO, _cmd, _workers
from torchrec_hybrid.spawn import free_port

RUN = ("--steps", "20", "--set", "checkpoint.every=5", "--set", "checkpoint.resume=auto",
       "--set", "metrics.window=3", "--set", "metrics.validation_batches=2", "--set", "dist.timeout_s=30",
       "--set", "dist.step_timeout_s=20")
LOG = ("--set", "train.log_level=warning")


def _final(stdout: str):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def test_attempt_store_keeps_each_restart_apart(monkeypatch):
    """Keys written by attempt 0 through the launcher's store are invisible to attempt 1."""
    from examples.dlrm.train import attempt_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(timedelta(seconds=5)) is None  # plain env://: a new store every attempt
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", TORCHELASTIC_RUN_ID="t").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_store(timedelta(seconds=5))
    first.set("rank_1", "address of a dead worker")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_store(timedelta(seconds=5))
    assert not second.check(["rank_1"])
    assert server.check(["dlrm/t/attempt_0/rank_1"])


def test_killed_worker_restarts_and_ends_as_the_uninterrupted_run(tmp_path):
    t0 = time.time()
    ref = subprocess.run(_cmd([*RUN, "--checkpoint-dir", str(tmp_path / "ref"), *LOG]), cwd=REPO,
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = _final(ref.stdout)
    ref_s = time.time() - t0

    ckpt, err = tmp_path / "ckpt", tmp_path / "stderr.txt"
    t1 = time.time()
    with open(err, "w") as f:
        proc = subprocess.Popen(_cmd([*RUN, "--checkpoint-dir", str(ckpt), *LOG],
                                     extra_torchrun=("--max-restarts", "1", "--monitor-interval", "0.2")),
                                cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=f, text=True,
                                start_new_session=True)
    workers = {}
    try:
        while time.time() - t1 < 40 and proc.poll() is None and not (ckpt / "step_5").exists():
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1] and (ckpt / "step_5").exists(), err.read_text()[-3000:]
        os.kill(workers[0], signal.SIGKILL)  # rank 0: it publishes checkpoints and prints the result
        killed_s = time.time() - t1
        try:
            stdout, _ = proc.communicate(timeout=75)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no result 75 s after the kill: {err.read_text()[-3000:]}") from None
    finally:
        leftovers = [*workers.values(), *(_workers(proc.pid).values() if proc.poll() is None else ())]
        for pid in [proc.pid, *leftovers]:  # the workers (restarted ones too) run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(timeout=10)
    text = err.read_text()
    assert proc.returncode == 0, text[-3000:]
    got = _final(stdout)
    assert got is not None and got["status"] == "completed", (stdout, text[-3000:])
    assert got["start_step"] >= 5, got  # the restart resumed from a checkpoint
    for key in ("step", "loss", "val_loss", "weights_sha256"):
        assert got[key] == want[key], (key, got[key], want[key])
    print(f"\nreference {ref_s:.1f} s; killed rank 0 at {killed_s:.1f} s, restarted from step "
          f"{got['start_step']}, finished {time.time() - t1:.1f} s after start: loss {got['loss']:.6f}, "
          f"weights {got['weights_sha256'][:16]}... as uninterrupted")
