#!/usr/bin/env bash
# Issue 40's study: do CF-GRPO's two mechanisms work where learning happens? Per world, arms cf (G rollouts + G edits),
# global (G rollouts: equal policy samples) and global-2x (2G rollouts: equal executions), >= 10 seeds, on the testbed's
# random-tiny-bpe base (lemon.testbed.vocab) with every confound fix on: duties pay only for what the world rewards,
# forced tokens carry no advantage, canonical enum tokens, stratified steps. Budgets come from the pilot (LOG.md).
#
#   bash experiments/mechanisms.sh [OUT]       # default OUT = outputs/testbed/mechanisms; resumable (finished runs are
#                                              # skipped, an interrupted one continues from its checkpoint)
#   touch OUT/<world>/STOP                     # stop a chain between runs
#   python -m lemon.testbed.study OUT          # report: per-arm tables, paired tests + TOST verdicts, curves
#
# Knobs (environment): SEEDS ("0 .. 9"), ARMS ("cf global global-2x"), STEPS (200), EVAL_EVERY (25), THRESHOLD (0.10),
# WORLDS_A ("duty edge multi"), WORLDS_B ("tiny mixed multi-sampled"; "" = both chains run WORLDS_A, seeds split).
# A world name ending in -sampled runs that world with sampled scoring (one simulated outcome per execution: the
# outcome noise CF is meant to beat).
# Two chains, one thread each (2 cores), seeds in the outer loop so every finished seed is a finished set of arms.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/testbed/mechanisms}
SEEDS=${SEEDS:-"0 1 2 3 4 5 6 7 8 9"}
ARMS=${ARMS:-"cf global global-2x"}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-25}
THRESHOLD=${THRESHOLD:-0.10}
WORLDS_A=${WORLDS_A:-"duty edge multi"}
WORLDS_B=${WORLDS_B-"tiny mixed multi-sampled"}
COMMON=(--base random-tiny-bpe --profile smoke --steps "$STEPS" --train-questions 32 --heldout 16 --eval-every "$EVAL_EVERY"
        --threshold "$THRESHOLD" --set num_generations=4 batch_size=8 learning_rate=2e-2 resample=0 role_chars=12
        duty_chars=16 curriculum=false stratify=true)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
chain() {
  for s in $SEEDS; do
    for w in "$@"; do
      world=${w%-sampled}
      scoring=exact
      [ "$w" != "$world" ] && scoring=sampled
      bash experiments/testbed_chain.sh "$OUT/$w" "$ARMS" "$s" --world "$world" --scoring "$scoring" "${COMMON[@]}"
    done
  done
}
if [ -z "$WORLDS_B" ]; then
  # One list of worlds (WORLDS_B=""): both chains run it, chain a the even-numbered and chain b the odd-numbered entries
  # of SEEDS, so one world's study uses both cores (lemon.testbed.experiment locks experiment.json for the shared folder).
  read -r -a S <<< "$SEEDS"
  EVEN="" ODD=""
  for i in "${!S[@]}"; do if (( i % 2 == 0 )); then EVEN+=" ${S[$i]}"; else ODD+=" ${S[$i]}"; fi; done
  SEEDS=$EVEN chain $WORLDS_A > "$OUT/chain-a.log" 2>&1 &
  a=$!
  SEEDS=$ODD chain $WORLDS_A > "$OUT/chain-b.log" 2>&1 &
  b=$!
else
  chain $WORLDS_A > "$OUT/chain-a.log" 2>&1 &
  a=$!
  chain $WORLDS_B > "$OUT/chain-b.log" 2>&1 &
  b=$!
fi
echo "[mechanisms] chains $a (${WORLDS_A}) and $b (${WORLDS_B}); logs $OUT/chain-{a,b}.log"
wait $a $b
.venv/bin/python -m lemon.testbed.study "$OUT"
