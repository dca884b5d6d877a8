#!/usr/bin/env bash
# Copy a testbed study's records (no checkpoints, adapters or trainer folders) into outputs/reference/, large ones gzipped,
# then rebuild its report there:  bash experiments/pack_reference.sh SRC DEST
#   e.g. bash experiments/pack_reference.sh outputs/testbed/cf-seeds outputs/reference/cf-seeds-20261205
# The copy regenerates exactly: python -m lemon.testbed.study DEST (lemon.testbed.experiment.read_text reads *.gz).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$1 DEST=$2
for exp in "$SRC"/*/experiment.json; do
  w=$(basename "$(dirname "$exp")")
  mkdir -p "$DEST/$w"
  cp "$exp" "$DEST/$w/"
  for run in "$SRC/$w"/*/seed-*/; do
    [ -f "$run/run.json" ] || continue
    rel=${run#"$SRC/"}
    mkdir -p "$DEST/$rel"
    cp "$run/run.json" "$DEST/$rel"
    for f in rollouts.jsonl heldout.jsonl train.json manifest.json; do  # metrics.jsonl: the same rows as train.json's history
      if [ -f "$run/$f" ]; then gzip -9 -c "$run/$f" > "$DEST/$rel/$f.gz"
      elif [ -f "$run/$f.gz" ]; then cp "$run/$f.gz" "$DEST/$rel/"  # a run copied from an earlier packed record
      fi
    done
  done
done
.venv/bin/python -m lemon.testbed.study "$DEST" > /dev/null
du -sh "$DEST"
