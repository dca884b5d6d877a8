#!/usr/bin/env bash
# The paper profile's three workers on ONE GPU: one vLLM OpenAI-compatible server per capacity (paper §3: small / medium /
# large = Qwen2.5-7B / 14B / 32B-Instruct), beside the 7B LoRA policy that `lemon train --profile paper` trains on the same GPU.
# configs/workers-paper.yaml (and the paper preset in lemon/train/config.py) point at these ports and served names.
#   bash scripts/vllm_workers.sh            # start all three, wait for /health, stay in the foreground; Ctrl-C stops them
#   LEMON_VLLM_LOGS=DIR ...                 # logs (default outputs/vllm-workers)
#   LEMON_VLLM_UTIL="0.15 0.13 0.22" ...    # --gpu-memory-utilization per server (small medium large), see the plan
#   LEMON_VLLM_MODELS="m1 m2 m3" ...        # other checkpoints (e.g. all bf16 on an 8-GPU node: see README)
# Needs a CUDA machine with vLLM installed (requirements-gpu.txt, its own environment) and the checkpoints on the HF hub or
# in the HF cache. NOT RUN by this project yet (no GPU with vLLM was available): the plan below is arithmetic from
# parameter counts, to be checked against vLLM's startup log ("model weights took X GiB", "KV cache ... tokens").
#
# Memory plan for one 141 GB GPU (H200). vLLM's --gpu-memory-utilization is a fraction of the WHOLE GPU that one server may
# hold (weights + activations + CUDA graphs + KV cache), so the fractions of co-located servers add up; the rest is the
# policy's. Servers start one after another: each profiles the memory that is free when it starts.
#
# | capacity | served as (model name in requests)  | checkpoint loaded               | weights | util | GB of 141 | KV left      |
# |----------|-------------------------------------|---------------------------------|---------|------|-----------|--------------|
# | small    | Qwen/Qwen2.5-7B-Instruct            | Qwen/Qwen2.5-7B-Instruct (bf16) | ~15.2   | 0.15 | ~21.2     | ~4 GB  ~70k tok (56 KB/tok)  |
# | medium   | Qwen/Qwen2.5-14B-Instruct           | Qwen/Qwen2.5-14B-Instruct-AWQ   | ~10.0   | 0.13 | ~18.3     | ~6 GB  ~32k tok (192 KB/tok) |
# | large    | Qwen/Qwen2.5-32B-Instruct           | Qwen/Qwen2.5-32B-Instruct-AWQ   | ~19.3   | 0.22 | ~31.0     | ~9 GB  ~36k tok (256 KB/tok) |
# | policy   | Qwen2.5-7B-Instruct + LoRA r=16     | Unsloth, bf16 (4-bit optional)  | ~15.2   |  -   | ~70 left  | optimizer, activations, G=4 rollouts |
#
# Workers total 0.50 of the GPU. ~2 GB per server goes to activations and CUDA graphs before the KV cache, and each process's
# CUDA context (~0.5-1 GB, the policy's too) sits OUTSIDE every fraction: budget ~3 GB for the four contexts. The policy's
# training step was measured on an H200 (outputs/reference/gpu-check-20261204: random-init 7B shape, LoRA r=16, batch 16,
# prompt 970 + completion 740, gradient checkpointing on, as the paper preset sets it): peak 34.1 GiB, 3.8 s; off: 134 GiB
# at micro-batch 8, which would NOT fit beside the workers. --max-model-len
# 8192 covers the executor's worst prompt (8 agents) plus a 1024-token reply, so the large server holds ~4 full-length or
# ~20 typical (~1.5k-token) sequences at once; lower max_concurrency in the workers YAML if requests queue. AWQ keeps the
# 14B / 32B within a few points of bf16 on GSM8K/MMLU in Qwen's reports; use the bf16 checkpoints when you have the memory
# (a second GPU, or the multi-node form in README) and say which you used: it is part of the result.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a MODELS <<<"${LEMON_VLLM_MODELS:-Qwen/Qwen2.5-7B-Instruct Qwen/Qwen2.5-14B-Instruct-AWQ Qwen/Qwen2.5-32B-Instruct-AWQ}"
read -r -a UTIL <<<"${LEMON_VLLM_UTIL:-0.15 0.13 0.22}"
NAMES=(Qwen/Qwen2.5-7B-Instruct Qwen/Qwen2.5-14B-Instruct Qwen/Qwen2.5-32B-Instruct)  # = configs/workers-paper.yaml
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
