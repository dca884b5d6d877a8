#!/usr/bin/env bash
# The device check (issue 29; bench/gpu_check.py says what it checks): the CF-GRPO trainer's CUDA path without Unsloth on a
# tiny random Qwen2, grammar rollouts, the CF loss against the CPU, and a 7B-shaped memory/speed probe.
#   bash scripts/gpu_check.sh [OUT_DIR] [-- extra bench/gpu_check.py args]      (default OUT_DIR: outputs/gpu_check)
# On a bare offline GPU machine (torch, transformers, peft present): first `bash scripts/gpu_pack.sh` where PyPI is reachable,
# carry .whl and .gpu; this script installs the wheels into /tmp/lemon-site and reads the tokenizer and data from .gpu.
# Elsewhere (the CPU stack, or scripts/setup-gpu.sh's .venv-gpu) it runs with what is installed.
# Python: $PYTHON, else .venv-gpu/bin/python, else .venv/bin/python (the CPU stack), else python3; it says which.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}; shift || true; [ "${1:-}" = "--" ] && shift
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON why='$PYTHON'
elif [ -x .venv-gpu/bin/python ]; then PY=.venv-gpu/bin/python why='the GPU environment'
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python why='the CPU environment'
else PY=python3 why='no .venv-gpu or .venv here'
fi
echo "gpu_check: python $PY ($why)"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lemon-site .whl/*.whl
  export PYTHONPATH=/tmp/lemon-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .gpu/data ] && export LEMON_DATA_DIR=$PWD/.gpu/data
args=(); [ -d .gpu/tokenizer ] && args=(--tokenizer .gpu/tokenizer)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$PY" bench/gpu_check.py --out "$OUT" "${args[@]}" "$@"
