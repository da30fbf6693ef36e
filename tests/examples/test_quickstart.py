"""The README's runnable first use: examples/quickstart.py under torchrun on 2 gloo ranks."""

import ast
import json
import math
import os
import subprocess
import sys

from torchrec_hybrid.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def test_quickstart_prints_the_plan_comparison_and_trains():
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(REPO, "examples", "quickstart.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("plan candidates (busiest-rank / mean bytes per step"), lines
    candidates = lines[1:-1]
    assert len(candidates) == 3 and sum(c.startswith("*") for c in candidates) == 1, candidates
    assert any("stock: TorchRec's EmbeddingShardingPlanner" in c for c in candidates), candidates
    out = json.loads(lines[-1])
    chosen = next(c for c in candidates if c.startswith("*"))
    types = ast.literal_eval(chosen[chosen.index("{"):])  # tables per type of the returned plan
    assert sum(types.values()) == 26
    assert len(out["hybrid_tables"]) == sum(n for t, n in types.items() if t.startswith("frequency_hybrid"))
    assert math.isfinite(out["last_loss"]) and out["bytes_sent_last_step"] > 0 and out["tables"] == 26
    # FBGEMM's dense TBE op has no kernel under the Autograd key; the hot pooling silences PyTorch's warning
    # about it (its gradient is checked against stock table_wise elsewhere), and nothing else
    assert "autograd kernel was not registered" not in proc.stderr
