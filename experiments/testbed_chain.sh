#!/usr/bin/env bash
# Run a testbed comparison one (arm, seed) per invocation of experiments/testbed_run.py, seed-major (every arm's seed 0, then
# every arm's seed 1, ...), so that a crash or a stopped session loses at most one run and leaves every arm with as many
# seeds as the time allowed. Finished runs are skipped (testbed_run.py is resumable); experiment.json merges the arms and
# seeds and keeps every command. The last step rebuilds summary.md over every arm recorded in the folder.
#   bash experiments/testbed_chain.sh OUT "edge role capacity" "0 1 2" --world tiny --profile smoke --steps 10 ...
# Stop between runs: touch OUT/STOP (the run in progress finishes first).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1 ARMS=$2 SEEDS=$3
shift 3
PY=.venv/bin/python
for seed in $SEEDS; do
  for arm in $ARMS; do
    if [ -e "$OUT/STOP" ]; then echo "[chain] $OUT/STOP found: stopping before $arm seed $seed"; break 2; fi
    echo "[chain] $(date -u +%FT%TZ) $arm seed $seed"
    "$PY" experiments/testbed_run.py --out "$OUT" --arms "$arm" --seeds "$seed" "$@"
  done
done
{ read -r -a ALL; read -r -a ALL_SEEDS; } < <("$PY" -c 'import json, sys; c = json.load(open(sys.argv[1]))["config"]
print(*c["arms"]); print(*c["seeds"])' "$OUT/experiment.json")
echo "[chain] $(date -u +%FT%TZ) report over arms ${ALL[*]} seeds ${ALL_SEEDS[*]}"
"$PY" experiments/testbed_run.py --out "$OUT" --report --arms "${ALL[@]}" --seeds "${ALL_SEEDS[@]}" "$@"
