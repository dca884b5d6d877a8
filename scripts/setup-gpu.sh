#!/usr/bin/env bash
# Create .venv-gpu in the repo root: the GPU environment of `scripts/main.sh --profile paper` (CUDA torch, unsloth, vLLM, trl,
# the notebook stack), kept apart from the CPU .venv (scripts/setup.sh) because unsloth caps trl / transformers / datasets
# below the CPU pins (requirements-gpu.in says which and why). Every package is pinned and sha256-checked (requirements-gpu.txt).
#   bash scripts/setup-gpu.sh [--no-gpu-check]     # --no-gpu-check: install even where nvidia-smi is missing (CI, image builds)
# Without --no-gpu-check it fails unless the driver is >= 580 and, after the install, torch sees CUDA and runs a matmul.
#   PYTHON=/path/to/python3.12 bash scripts/setup-gpu.sh
# Needs Linux x86_64, Python 3.12 (the wheels are cp312), glibc >= 2.31 and an NVIDIA driver for CUDA 13 (torch 2.14.0 cu130).
# Idempotent: rerunning reuses .venv-gpu and installs only what is missing or different.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_CHECK=1
for arg in "$@"; do
  case $arg in
    --no-gpu-check) GPU_CHECK=0 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "setup-gpu: unknown argument $arg (usage: bash scripts/setup-gpu.sh [--no-gpu-check])" >&2; exit 2 ;;
  esac
done
if [ "$GPU_CHECK" = 1 ]; then
  if ! command -v nvidia-smi >/dev/null; then
    echo "setup-gpu: ERROR: nvidia-smi not found: this machine has no NVIDIA GPU (or no driver). The GPU environment needs one" \
      "(CUDA 13 driver). Use bash scripts/setup.sh for the CPU stack, or pass --no-gpu-check to install anyway." >&2
    exit 1
  fi
  nvidia-smi -L >/dev/null 2>&1 || {
    echo "setup-gpu: ERROR: nvidia-smi found but it lists no GPU (nvidia-smi -L failed); pass --no-gpu-check to install anyway" >&2
    exit 1
  }
  # torch 2.14.0 cu130 (requirements-gpu.txt) needs a CUDA 13 driver, >= 580: say so before a long install
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  major=${driver%%.*}
  if [[ ! $major =~ ^[0-9]+$ ]] || [ "$major" -lt 580 ]; then
    echo "setup-gpu: ERROR: NVIDIA driver '${driver:-unknown}' is older than 580, which the CUDA 13 torch of" \
      "requirements-gpu.txt needs: upgrade the driver (or pass --no-gpu-check to install anyway)" >&2
    exit 1
  fi
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif command -v python3.12 >/dev/null && python3.12 -c '' 2>/dev/null; then PY=python3.12
else PY=python3
fi
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || echo "setup-gpu: WARNING: $PY is Python" \
  "$("$PY" -c 'import platform; print(platform.python_version())'), but requirements-gpu.txt was resolved for 3.12 (cp312 wheels):" \
  "expect 'no matching distribution' or hash errors; install python3.12 or set PYTHON=" >&2
[ -x .venv-gpu/bin/python ] || "$PY" -m venv .venv-gpu
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv-gpu/bin/python -m pip install -q --upgrade pip
# --only-binary: every pinned package has a wheel for the target; a missing one (old glibc, other Python) fails here rather
# than building an sdist whose hash is not listed.
.venv-gpu/bin/python -m pip install --require-hashes --only-binary=:all: -r requirements-gpu.txt
.venv-gpu/bin/python -m pip install -q --no-deps -e .
.venv-gpu/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null  # the notebooks' kernel (papermill kernel_name="python3")
.venv-gpu/bin/python - <<'EOF'
from importlib.metadata import version
import torch
print(f"setup-gpu: torch {torch.__version__} (CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}); "
      f"cuda available: {torch.cuda.is_available()}; devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"setup-gpu:   cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
print("setup-gpu: " + ", ".join(f"{p} {version(p)}" for p in
      ("unsloth", "unsloth_zoo", "vllm", "trl", "transformers", "peft", "accelerate", "datasets", "llguidance")))
EOF
if [ "$GPU_CHECK" = 1 ]; then  # a CUDA build, a driver new enough for it, a matmul on the GPU (gpuplan.check_cuda)
  .venv-gpu/bin/python -m lemon.run.gpuplan --check-cuda || {
    echo "setup-gpu: ERROR: .venv-gpu is installed but CUDA is not usable from it (the line above says why)" >&2
    exit 1
  }
  .venv-gpu/bin/python -m lemon.run.gpuplan || echo "setup-gpu: WARNING: this GPU holds no memory plan of the paper" \
    "profile (above): scripts/main.sh --profile paper will refuse it" >&2
fi
echo "setup-gpu: .venv-gpu ready; run the paper profile with: bash scripts/main.sh --profile paper"
