#!/usr/bin/env bash
# One command that builds the venv for the real torch_xla / torchax route tests (pytest marker
# `torch_tpu_routes`) and, with --test, runs them:
#
#   bash .ci/torch_tpu_routes_venv.sh [VENV_DIR] [--test]
#
# VENV_DIR defaults to ./.venv-xla (gitignored). The pairing (tested together; see
# docs/torch_tpu_routes.md): torch 2.9.0 (CPU build) + torch_xla 2.9.0 + torchax 0.0.13 with
# flashport's jax 0.10.2 / jaxlib 0.10.2. torchax 0.0.13 does not import on torch > 2.9, and
# torch_xla's call_jax imports torchax, so both routes share this one venv. torch_xla[pallas] is NOT
# installed: it pins jax 0.7.1, below flashport's range; flashport brings its own Pallas kernels.
# torchax 0.0.13 imports flax (torchax.checkpoint) without declaring it, so flax is installed too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv-xla
RUN_TESTS=0
for arg in "$@"; do
  case "$arg" in
    --test) RUN_TESTS=1 ;;
    *) VENV=$arg ;;
  esac
done
command -v "$PY" >/dev/null 2>&1 || PY=python3

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch from PyPI (its Linux wheel brings the CUDA libraries; only the CPU is used). Set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the smaller CPU-only build where reachable.
"$VENV/bin/pip" install -q torch==2.9.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$VENV/bin/pip" install -q torch_xla==2.9.0 torchax==0.0.13 jax==0.10.2 jaxlib==0.10.2 \
  "flax>=0.12,<0.13" "pytest>=8" "hypothesis>=6.100" numpy "libcst>=1.4,<2" "rich>=13.7" "pathspec>=0.12"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
for name in ("torch", "torch_xla", "torchax", "jax", "jaxlib"):
    print(f"{name}=={m.version(name)}")
PY

if [ "$RUN_TESTS" = 1 ]; then
  # addopts carries "-n auto" and deselects the marker: this run is serial and selects it.
  PJRT_DEVICE=CPU "$VENV/bin/python" -m pytest -o addopts="-ra --strict-markers" -p no:xdist \
    -m torch_tpu_routes tests/test_torch_tpu_routes.py
fi
