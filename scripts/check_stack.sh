#!/usr/bin/env bash
# Checks this package on another supported TorchRec stack: builds a venv with that stack, installs the
# package (with its fused CPU ops) and runs the correctness core of the suite there - equivalence with
# stock table_wise, checkpoints, quantized comms, TorchRec's harness, _compat, the sharder's refusals
# and the planner. Appends the outcome to benchmarks/results/stacks.json (the README's stack table).
#
#   scripts/check_stack.sh 1.9.2          # torchrec 1.9.2, fbgemm-gpu-cpu 1.9.0, torch 2.14.0
#   scripts/check_stack.sh 1.8.0          # the pinned stack (scripts/setup.sh's)
#
# The venv goes to .venv-stack-TORCHREC_VERSION (kept: run again to re-test without downloading).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 TORCHREC_VERSION   (one of: 1.8.0 1.9.2)" >&2; exit 2; }
TORCHREC=$1
case "$TORCHREC" in
  1.8.0) TORCH=2.13.0; FBGEMM=1.8.0 ;;
  1.9.2) TORCH=2.14.0; FBGEMM=1.9.0 ;;  # torch 2.14 on PyPI is its CUDA build: it runs on CPU too
  *) echo "torchrec $TORCHREC: not a stack this script knows (1.8.0, 1.9.2); add its torch and fbgemm here" >&2
     exit 2 ;;
esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-stack-$TORCHREC
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
PIP="$VPY -m pip install --disable-pip-version-check -q"
if ! $VPY -c "import torch, torchrec, fbgemm_gpu" >/dev/null 2>&1; then
  echo "[check_stack] installing torch $TORCH, fbgemm-gpu-cpu $FBGEMM, torchrec $TORCHREC into $VENV"
  $PIP "torch==$TORCH"
  $PIP "fbgemm-gpu-cpu==$FBGEMM"
  $PIP --no-deps "torchrec==$TORCHREC"  # its metadata wants the CUDA-only fbgemm-gpu
  $PIP tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath
fi
$PIP numpy pyyaml pytest pytest-timeout "setuptools>=77" ninja
# a copy of this checkout's tracked files (the checkout's own build belongs to the pinned stack), its fused
# ops built there against this venv's torch; the tests run in the copy
SRC=$VENV/src
rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$SRC"
VPY=$PWD/$VPY
(cd "$SRC" && $VPY setup.py -q build_ext --inplace >/dev/null 2>&1) \
  || echo "[check_stack] the fused ops did not build here: the tests run the composed fallback"
CORE=(tests/test_sharded_ebc_equivalence.py tests/test_sharded_ebc_checkpoint.py tests/test_sharded_ebc_qcomms.py
      tests/test_torchrec_harness.py tests/test_compat.py tests/test_sharder_refusals.py tests/planner)
LOG=$PWD/$VENV/pytest.log
set +e
(cd "$SRC" && $VPY -m pytest -q -p no:cacheprovider "${CORE[@]}") 2>&1 | tee "$LOG" | tail -3
RC=${PIPESTATUS[0]}
set -e
(cd "$SRC" && $VPY - "$LOG" "$RC" "$OLDPWD") <<'EOF'
import datetime, json, os, re, subprocess, sys
import fbgemm_gpu, torch, torchrec
from importlib.metadata import version
log, rc, repo = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tail = open(log).read().strip().splitlines()[-1]
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
try:
    from torchrec_hybrid.sharding import fused
    fused_ops = fused.available()
except Exception:
    fused_ops = False
entry = {"torchrec": version("torchrec"), "fbgemm_gpu": fbgemm_gpu.__version__, "torch": torch.__version__,
         "python": sys.version.split()[0], "date": datetime.date.today().isoformat(),
         "commit": subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip(),
         "passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
         + counts.get("errors", 0), "skipped": counts.get("skipped", 0), "exit_code": rc, "fused_ops": fused_ops}
path = os.path.join(repo, "benchmarks/results/stacks.json")
runs = json.load(open(path))["runs"] if os.path.exists(path) else []
runs = [r for r in runs if (r["torchrec"], r["fbgemm_gpu"], r["torch"]) != (entry["torchrec"], entry["fbgemm_gpu"],
                                                                               entry["torch"])] + [entry]
with open(path, "w") as f:
    json.dump({"runs": runs}, f, indent=1)
print(f"[check_stack] torchrec {entry['torchrec']}, fbgemm {entry['fbgemm_gpu']}, torch {entry['torch']}: "
      f"{entry['passed']} passed, {entry['failed']} failed, {entry['skipped']} skipped -> {path}")
EOF
exit "$RC"
