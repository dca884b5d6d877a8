#!/usr/bin/env bash
# The whole study in one command: notebooks 01 -> 04 executed with papermill into outputs/<profile>-<timestamp>/.
#   scripts/main.sh --profile test|smoke|cpu|cpu-long|cpu-wide|paper [--out DIR | --resume] [--seed N] [--quiet]
# test: tests/test_notebooks.py's study (1 question per benchmark, ~4 min on 2 idle cores); smoke: the full-size smoke
# study (2 questions on each of the 6 benchmarks, 9 methods, 3 trained variants; ~18 min on 2 lightly loaded cores).
# An existing --out DIR (or --resume: the newest outputs/<profile>-*) is resumed: finished notebooks are skipped, training
# resumes from checkpoints, evaluation from results.jsonl. Default profile: cpu (does CF-GRPO training help with the embedded
# models? 60 paired math questions; 116 min measured on 2 idle cores, 2026-12-02).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m lemon.study "$@"
