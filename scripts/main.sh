#!/usr/bin/env bash
# The whole study in one command: notebooks 01 -> 04 executed with papermill into outputs/<profile>-<timestamp>/.
#   scripts/main.sh --profile test|smoke|cpu|cpu-long|cpu-wide|paper [--out DIR | --resume] [--seed N] [--quiet]
#                   [--set FIELD=VALUE ...] [--workers FILE]
# Profiles live in configs/profiles.yaml (what each answers, its models, what it took); --set overrides any StudyConfig
# field for this run (train.FIELD / sft.FIELD reach the trainer / warm start), --workers replaces the profile's workers.
# test: tests/test_notebooks.py's study (1 question per benchmark, ~4 min on 2 idle cores); smoke: the full-size smoke
# study (2 questions on each of the 6 benchmarks, 9 methods, 3 trained variants; ~18 min on 2 lightly loaded cores).
# An existing --out DIR (or --resume: the newest outputs/<profile>-*) is resumed: finished notebooks are skipped, training
# resumes from checkpoints, evaluation from results.jsonl. Default profile: cpu (does CF-GRPO training help with the embedded
# models? 90 paired math questions; its measured time is in configs/profiles.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
# --profile paper runs in the GPU environment (.venv-gpu: CUDA torch, unsloth, vLLM; bash scripts/setup-gpu.sh builds it), every
# other profile in the CPU environment (.venv; bash scripts/setup.sh).
PY=.venv/bin/python
profile= workers= prev=
for arg in "$@"; do  # the last --profile (--workers) wins, as in argparse
  if [ "$prev" = --profile ]; then profile=$arg; fi
  if [ "$prev" = --workers ]; then workers=$arg; fi
  case $arg in --profile=*) profile=${arg#--profile=} ;; --workers=*) workers=${arg#--workers=} ;; esac
  prev=$arg
done
if [ "$profile" = paper ]; then
  PY=.venv-gpu/bin/python
  if [ ! -x "$PY" ]; then
    echo "main.sh: --profile paper runs in the GPU environment $PY, which is missing: run \`bash scripts/setup-gpu.sh\` first" \
      "(a CUDA machine; see requirements-gpu.in)" >&2
    exit 1
  fi
  # The GPU memory plan (python -m lemon plan-gpu; LEMON_GPU_GIB=N plans for N GiB): a card that holds no plan stops
  # here, and the plan's --set overrides (micro-batch 4 on an 80 GB card) go BEFORE the user's: an explicit --set wins.
  if [ "${LEMON_GPU_PLAN:-on}" != off ]; then
    plan_args=(--shell)
    if [ -n "${LEMON_GPU_GIB:-}" ]; then plan_args+=(--gib "$LEMON_GPU_GIB"); fi
    if [ -n "$workers" ]; then plan_args+=(--workers "$workers"); fi
    plan=$("$PY" -m lemon.run.gpuplan "${plan_args[@]}") || {
      echo "main.sh: --profile paper refused by the GPU memory plan above; nothing started (LEMON_GPU_PLAN=off skips" \
        "the plan, e.g. when the workers run on other GPUs)" >&2
      exit 1
    }
    eval "$plan"
    pre=()
    for s in ${SETS[@]+"${SETS[@]}"}; do pre+=(--set "$s"); done
    if [ ${#pre[@]} -gt 0 ]; then echo "main.sh: GPU plan '$STRATEGY' adds: ${pre[*]}" >&2; fi
    set -- ${pre[@]+"${pre[@]}"} "$@"
  fi
fi
exec "$PY" -m lemon.study "$@"
