#!/usr/bin/env bash
# Copy a papermill study's small records into outputs/reference/ (no adapters, checkpoints, node caches or notebooks):
#   bash experiments/pack_study.sh outputs/cpu-20261205 outputs/reference/cpu-20261205
# Kept: config / manifest / summary / timings, the plots, every per-question results.jsonl (the paired statistics are
# computed from these), the CF-GRPO metrics and rollouts, the SFT corpus and record.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1%/} DEST=${2%/}
[ -f "$SRC/config.json" ] || { echo "pack_study: $SRC is not a study folder (no config.json)" >&2; exit 1; }
mkdir -p "$DEST"
for f in config.json manifest.json summary.md timings.json; do [ -f "$SRC/$f" ] && cp "$SRC/$f" "$DEST/"; done
(cd "$SRC" && find . \( -path './plots/*.png' -o -name results.jsonl -o -name summary.json \
    -o -path './train/grpo/metrics.jsonl' -o -path './train/grpo/rollouts.jsonl' -o -path './train/grpo/train.json' \
    -o -path './train/sft/corpus.jsonl' -o -path './train/sft/sft.json' -o -path './data/stats.json' -o -path './data/samples.json' -o -path './data/checks.json' \) -print0) |
  while IFS= read -r -d '' f; do mkdir -p "$DEST/$(dirname "$f")"; cp "$SRC/$f" "$DEST/$f"; done
du -sh "$DEST"
