#!/usr/bin/env bash
# Create .venv in the repo root and install the pinned stack (CPU or CUDA fbgemm by what the
# machine has), then this package in editable mode. Safe to run again: it skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PIP="$VPY -m pip install --disable-pip-version-check -q"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM=fbgemm-gpu==1.8.0
else
  FBGEMM=fbgemm-gpu-cpu==1.8.0
fi
if ! $VPY -c "import torchrec, fbgemm_gpu" >/dev/null 2>&1; then
  echo "[setup] installing torch 2.13.0, $FBGEMM, torchrec 1.8.0 into .venv"
  $PIP torch==2.13.0
  $PIP "$FBGEMM"
  # torchrec's metadata requires the CUDA-only 'fbgemm-gpu' package: install it without deps.
  $PIP --no-deps torchrec==1.8.0
  $PIP tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath
fi
$PIP numpy pyyaml matplotlib pytest pytest-timeout "setuptools>=77" ninja
# the linter and type checker of the test command (configured in pyproject.toml)
$PIP ruff==0.17.6 mypy==2.4.1
# the package, editable, with its fused CPU ops (torchrec_hybrid/csrc, built against the torch above: hence no
# build isolation); a failed build leaves the composed fallback (torchrec_hybrid/sharding/fused.py says so)
$PIP --no-deps --no-build-isolation -e . || { echo "[setup] building the fused ops failed: installing without them";
  TORCHREC_HYBRID_NO_EXT=1 $PIP --no-deps --no-build-isolation -e .; }
echo "[setup] done: $($VPY -c 'import torch, torchrec, fbgemm_gpu; from torchrec_hybrid.sharding import fused; print("torch", torch.__version__, "fbgemm", fbgemm_gpu.__version__, "fused ops", "built" if fused.available() else "NOT built")')"
