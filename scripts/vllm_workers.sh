#!/usr/bin/env bash
# The paper profile's three workers on ONE GPU: one vLLM OpenAI-compatible server per capacity (paper §3: small / medium /
# large = Qwen2.5-7B / 14B / 32B-Instruct), beside the 7B LoRA policy that `lemon train --profile paper` trains on the same GPU.
# configs/workers-paper.yaml (and the paper preset in lemon/train/config.py) point at these ports and served names.
#   bash scripts/vllm_workers.sh            # start all three, wait for /health, stay in the foreground; Ctrl-C stops them
#   LEMON_VLLM_LOGS=DIR ...                 # logs (default outputs/vllm-workers)
#   LEMON_VLLM_UTIL="0.21 0.16 0.28" ...   # --gpu-memory-utilization per server (small medium large), not the plan's
#   LEMON_VLLM_MODELS="m1 m2 m3" ...        # other checkpoints (sizes known to lemon/run/gpuplan.py CHECKPOINTS)
#   LEMON_GPU_GIB=79.2 ...                  # plan for this card size instead of the one torch / nvidia-smi reports
#   LEMON_GPU_PLAN=off ...                  # skip the plan (then LEMON_VLLM_UTIL is required), e.g. one server per GPU
# Needs a CUDA machine with vLLM installed (requirements-gpu.txt, its own environment) and the checkpoints on the HF hub or
# in the HF cache. NOT RUN by this project yet (no GPU with vLLM was available).
#
# Memory: `python -m lemon plan-gpu` (lemon/run/gpuplan.py) plans the card first and this script starts nothing when no
# plan fits. The plan: checkpoint weights (7B bf16 ~14.2 GiB, 14B-AWQ ~9.3, 32B-AWQ ~18.0), ~2 GiB per server for
# activations and CUDA graphs, a KV cache of at least one --max-model-len sequence per server, the policy's measured
# training peak (outputs/reference/gpu-check-20261204: 34.1 GiB at micro-batch 16, gradient checkpointing on) and ~0.75
# GiB of CUDA context per process, with 4 GiB to spare. An 80 GB H100 (79.2 GiB) cannot hold all of it with the policy
# at micro-batch 16, so its plan trains at micro-batch 4 on the transformers backend (scripts/main.sh --profile paper
# applies the plan's --set overrides); a 141 GB H200 keeps everything resident and gives the spare to the KV caches.
# vLLM's --gpu-memory-utilization is a fraction of the WHOLE GPU that one server may hold (weights + activations + CUDA
# graphs + KV cache), so co-located servers' fractions add up; the rest is the policy's. Servers start one after
# another: each profiles the memory that is free when it starts. --max-model-len 8192 covers the executor's worst prompt
# (8 agents) plus a 1024-token reply; lower max_concurrency in the workers YAML if requests queue. AWQ keeps the 14B /
# 32B within a few points of bf16 on GSM8K/MMLU in Qwen's reports; use the bf16 checkpoints when you have the memory (a
# second GPU, or the multi-node form in README) and say which you used: it is part of the result.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv-gpu/bin/python ]; then PY=.venv-gpu/bin/python
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
if [ "${LEMON_GPU_PLAN:-on}" = off ]; then
  if [ -z "${LEMON_VLLM_UTIL:-}" ]; then
    echo "vllm_workers: LEMON_GPU_PLAN=off needs LEMON_VLLM_UTIL (3 fractions)" >&2; exit 1
  fi
  NAMES=(Qwen/Qwen2.5-7B-Instruct Qwen/Qwen2.5-14B-Instruct Qwen/Qwen2.5-32B-Instruct)  # = configs/workers-paper.yaml
  read -r -a MODELS <<<"${LEMON_VLLM_MODELS:-${NAMES[0]} ${NAMES[1]}-AWQ ${NAMES[2]}-AWQ}"
else
  plan_args=(--shell)
  if [ -n "${LEMON_GPU_GIB:-}" ]; then plan_args+=(--gib "$LEMON_GPU_GIB"); fi
  if [ -n "${LEMON_VLLM_MODELS:-}" ]; then
    read -r -a m <<<"$LEMON_VLLM_MODELS"; plan_args+=(--checkpoints "${m[@]}")
  fi
  # the plan (NAMES, MODELS, UTIL, STRATEGY) or nothing: a card that holds no plan stops here, before any server starts
  plan=$("$PY" -m lemon.run.gpuplan "${plan_args[@]}") || {
    echo "vllm_workers: refused by the GPU memory plan above; nothing started (LEMON_GPU_PLAN=off skips it)" >&2
    exit 1
  }
  eval "$plan"
fi
if [ -n "${LEMON_VLLM_UTIL:-}" ]; then read -r -a UTIL <<<"$LEMON_VLLM_UTIL"; fi
PORTS=(8001 8002 8003)
LOGS=${LEMON_VLLM_LOGS:-outputs/vllm-workers}
VLLM=${VLLM:-$( [ -x .venv-gpu/bin/vllm ] && echo .venv-gpu/bin/vllm || echo vllm )}
command -v "$VLLM" >/dev/null || { echo "vllm_workers: '$VLLM' not found; run bash scripts/setup-gpu.sh (.venv-gpu) on a CUDA machine" >&2; exit 1; }
[ ${#MODELS[@]} -eq 3 ] && [ ${#UTIL[@]} -eq 3 ] || { echo "vllm_workers: need 3 models and 3 utilizations" >&2; exit 1; }
mkdir -p "$LOGS"
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; wait || true; }
trap 'stop; exit 130' INT TERM
trap stop EXIT
for i in 0 1 2; do
  echo "vllm_workers: ${NAMES[$i]} <- ${MODELS[$i]} on :${PORTS[$i]} (--gpu-memory-utilization ${UTIL[$i]}), log $LOGS/${PORTS[$i]}.log"
  # setsid: each server (and its engine subprocesses) in its own group, stopped as a whole. --generation-config vllm: the
  # checkpoint's generation_config (Qwen: top_k 20, repetition_penalty 1.05) must not silently change lemon's sampling.
  setsid "$VLLM" serve "${MODELS[$i]}" --served-model-name "${NAMES[$i]}" --host 127.0.0.1 --port "${PORTS[$i]}" \
    --gpu-memory-utilization "${UTIL[$i]}" --max-model-len 8192 --max-num-seqs 64 --generation-config vllm \
    >"$LOGS/${PORTS[$i]}.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 900); do  # one at a time: each server measures the memory left free by the ones before it
    curl -sf "http://127.0.0.1:${PORTS[$i]}/health" >/dev/null && break
    kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "vllm_workers: ${NAMES[$i]} died; tail of its log:" >&2; tail -20 "$LOGS/${PORTS[$i]}.log" >&2; exit 1; }
    sleep 2
  done
  curl -sf "http://127.0.0.1:${PORTS[$i]}/health" >/dev/null || { echo "vllm_workers: ${NAMES[$i]} not healthy after 30 min" >&2; exit 1; }
done
echo "vllm_workers: all three healthy; use --workers configs/workers-paper.yaml (Ctrl-C stops them)"
wait
