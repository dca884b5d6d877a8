#!/usr/bin/env bash
# The first honest baseline table (issue 3 §5): CoT, SC-CoT, Chain, Complete on N seeded GSM8K test questions at each
# capacity of the embedded ladder (small = SmolLM2-135M, medium = Qwen2.5-Coder-0.5B, large = Qwen2.5-Coder-1.5B; llama.cpp).
# Resumable: every cell is a `python -m lemon eval` run folder; rerunning skips finished rows. Then prints the table and
# plots accuracy (95% CI) against tokens per question to $OUT/accuracy_vs_tokens.png.
#   bash bench/baseline_table.sh [N=30] [OUT=outputs/bench/baselines] [CAPACITIES="small medium large"]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-30}
OUT=${2:-outputs/bench/baselines}
CAPS=${3:-"small medium large"}
# most informative cells first (the 135M scores ~0 on GSM8K), so a partial run still says something
for method in cot chain complete sc-cot; do
  for cap in $CAPS; do
    .venv/bin/python -m lemon eval --method "$method" --benchmark gsm8k --split test --limit "$N" --seed 0 \
      --capacity "$cap" --n-agents 4 --k 3 --out "$OUT/$cap-$method" --quiet
  done
done
.venv/bin/python bench/table.py "$OUT" --plot "$OUT/accuracy_vs_tokens.png"
