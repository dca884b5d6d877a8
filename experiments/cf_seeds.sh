#!/usr/bin/env bash
# Issue 30, deliverable 4: CF-GRPO vs global GRPO at >= 10 seeds on each testbed world (tiny = capacity pays, duty, edge,
# mixed), plus each single edit family at 5 seeds on the mixed world. Every run: the random-tiny base drawn from its
# training seed (each seed an independent policy, shared by the arms of that seed), 10 steps of 2 questions x G=4,
# exact expected rewards, greedy held-out evaluation on 16 questions at steps 0, 5, 10.
#
#   bash experiments/cf_seeds.sh [OUT]        # default OUT = outputs/testbed/cf-seeds; resumable: finished runs are skipped
#
# Knobs (environment): SEEDS, FAMILY_SEEDS (empty = no family runs), STEPS (10), EVAL_EVERY (5), WORLDS_A ("mixed edge"),
# WORLDS_B ("duty tiny"). The longer-budget follow-up of 2026-12-05:
#   STEPS=30 EVAL_EVERY=10 WORLDS_A=mixed WORLDS_B=duty FAMILY_SEEDS= bash experiments/cf_seeds.sh outputs/testbed/cf-seeds-30
#
# Two chains run side by side with one thread each (2-core machine): chain A = mixed then edge (then the mixed world's
# families), chain B = duty then tiny. Seeds run in the outer loop, so every finished seed is a finished PAIR. Logs:
# OUT/chain-{a,b}.log. Report afterwards: python -m lemon.testbed.study OUT (tables, paired tests, plots).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/testbed/cf-seeds}
SEEDS=${SEEDS:-"0 1 2 3 4 5 6 7 8 9"}
FAMILY_SEEDS=${FAMILY_SEEDS-"0 1 2 3 4"}
STEPS=${STEPS:-10}
EVAL_EVERY=${EVAL_EVERY:-5}
WORLDS_A=${WORLDS_A:-"mixed edge"}
WORLDS_B=${WORLDS_B:-"duty tiny"}
COMMON=(--base random-tiny --profile smoke --steps "$STEPS" --train-questions 16 --heldout 16 --eval-every "$EVAL_EVERY"
        --set num_generations=4 batch_size=8 learning_rate=2e-2 resample=0 role_chars=12 duty_chars=16 curriculum=false)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
run() {  # world, arms..., then --seeds s
  local world=$1; shift
  .venv/bin/python experiments/testbed_run.py --world "$world" --out "$OUT/$world" "${COMMON[@]}" "$@"
}
chain() {
  for world in "$@"; do
    for s in $SEEDS; do run "$world" --arms cf global --seeds "$s"; done
  done
}
( chain $WORLDS_A
  for s in $FAMILY_SEEDS; do run mixed --arms edge role capacity --seeds "$s"; done ) > "$OUT/chain-a.log" 2>&1 &
a=$!
chain $WORLDS_B > "$OUT/chain-b.log" 2>&1 &
b=$!
wait $a; wait $b
echo "cf_seeds: done -> $OUT"
