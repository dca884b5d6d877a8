#!/usr/bin/env bash
# Fresh-machine setup time (issue 12: goal <= 12 min on 2 cores): clone this repo's HEAD into a temporary folder and run
# scripts/setup.sh there with pip's cache off, so nothing installed or built before is reused (the system's /opt/wheels
# find-links stay, as on a CI machine). Prints the wall time and peak RSS; the clone is deleted afterwards.
#   bash bench/setup_bench.sh            # uses committed HEAD (commit first to measure a change)
#   KEEP=1 bash bench/setup_bench.sh     # keep the clone and its log
# Run it on an otherwise idle machine: the llama.cpp compile takes both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/lemon-setup-bench.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT
git clone -q . "$dir/repo"
echo "setup_bench: $(git rev-parse --short HEAD) -> $dir/repo (PIP_NO_CACHE_DIR=1), load $(cut -d' ' -f1-3 /proc/loadavg)"
TIME=(); [ -x /usr/bin/time ] && TIME=(/usr/bin/time -f 'peak_rss_kb %M')  # GNU time for the peak RSS, when installed
start=$(date +%s)
( cd "$dir/repo" && PIP_NO_CACHE_DIR=1 "${TIME[@]}" bash scripts/setup.sh ) >"$dir/setup.log" 2>&1 \
  || { echo "setup_bench: setup FAILED; last lines:" >&2; tail -20 "$dir/setup.log" >&2; exit 1; }
secs=$(( $(date +%s) - start ))
grep -E '^setup:' "$dir/setup.log" | sed 's/^/  /'
echo "setup_bench: fresh setup took $secs s ($(( secs / 60 )) min $(( secs % 60 )) s), $(grep -o 'peak_rss_kb [0-9]*' "$dir/setup.log" || echo 'peak RSS not measured')"
