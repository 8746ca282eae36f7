#!/usr/bin/env bash
# Restore on a node that never saw the snapshot: pull alone, restore alone, and the two
# overlapped, side by side in one run (bench/pull_restore_bench.cc says what and how). Root;
# needs CRIU and docker-registry (scripts/install-deps).
#
#   BUILD=build bench/pull_restore_bench.sh OUTDIR [REGION_MIB=1024] [CPU_MIB=256] [RUNS=3] [RATE_MIB=256]
#
# Writes OUTDIR/results.md, OUTDIR/runs.jsonl and OUTDIR/log (as it goes).
set -euo pipefail
OUT=${1:?usage: pull_restore_bench.sh OUTDIR [REGION_MIB] [CPU_MIB] [RUNS] [RATE_MIB]}
shift
BUILD=${BUILD:-build}
mkdir -p "$OUT"
{
  echo "bench: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "gpusnap $(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo '?')"
} | tee "$OUT/log"
timeout 3600 "$BUILD/bench/gpusnap-pull-restore-bench" "$OUT" "$@" 2>&1 | tee -a "$OUT/log"
