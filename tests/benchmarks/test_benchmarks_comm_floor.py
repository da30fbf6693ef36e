"""`python -m benchmarks.comm_floor` at a tiny size: each plan's collectives, recorded from one of its
steps and replayed alone, send what the plan's steps send, and the replay is timed beside the steps."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_comm_floor_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.comm_floor", "--world", "2", "--rows-cap", "2000",
                           "--workloads", "onehot", "--steps", "3", "--warmup", "1", "--repeats", "2",
                           "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from benchmarks.workloads import MODELS

    (r,) = json.loads((tmp_path / "comm_floor.json").read_text())
    assert r["workload"] == "onehot" and list(r["plans"]) == list(MODELS)
    assert r["plans"]["stock_planner"]["types"] == {"table_wise": 26}
    for name, p in r["plans"].items():
        # every collective of a step is recorded (TorchRec's input dist alone issues several), and its replay
        # sends the bytes the step sends: the ids differ per batch, so not to the byte
        assert len(p["collectives"]) >= 3 and all(c.startswith("c10d::") for c in p["collectives"]), name
        assert abs(p["collectives_bytes_busiest"] / p["step_bytes_busiest"] - 1) < 0.1, name
        assert len(p["step_s"]) == len(p["collectives_s"]) == 6  # 2 runs x 3 steps
        assert 0 < p["median_collectives_s"] and 0 < p["median_step_s"]
        assert len(p["each_s"]) == len(p["each_buffer_bytes"]) == len(p["collectives"])
        lo, mid, hi = p["bytes_only_bound"]
        assert lo <= mid <= hi
    assert r["plans"]["stock_planner"]["bytes_only_bound"] == [1.0, 1.0, 1.0]
    md = (tmp_path / "comm_floor.md").read_text()
    assert "bytes-only bound" in md and md.count("| onehot B=1024 |") == 2 * len(MODELS)


def test_recorder_replays_what_it_recorded():
    """Outside a process group: the recorder keeps only collectives, with fresh buffers of their sizes."""
    import torch

    from benchmarks.comm_floor import CollectiveRecorder, _fresh

    x = [torch.ones(3, dtype=torch.int32), (torch.zeros(2, 5),)]
    y = _fresh(x)
    assert y[0].shape == (3,) and y[0].dtype == torch.int32 and y[0] is not x[0]
    assert isinstance(y[1], tuple) and y[1][0].shape == (2, 5)
    with CollectiveRecorder() as rec:
        torch.ones(4).sum()
    assert rec.calls == [] and rec.names() == []
