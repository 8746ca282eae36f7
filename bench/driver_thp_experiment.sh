#!/usr/bin/env bash
# An experiment, not a product path: how fast is the driver's checkpoint (GPU -> a fresh
# anonymous region it maps in the process) with 4 KiB pages and with transparent huge pages?
# The region is mapped by the driver without MADV_HUGEPAGE, so with THP at `madvise` (the
# usual distribution default) every 4 KiB of it is a first-touch page fault.
#
#   bench/driver_thp_experiment.sh OUTDIR [GIB] [MODES]
#     MODES  values written to /sys/kernel/mm/transparent_hugepage/enabled in turn
#            (default "madvise always"); the setting found is put back at the end.
#
# For each mode: start tests/cuda_pattern with GIB GiB on the GPU, time the driver's lock,
# checkpoint, restore and unlock (bench/cuda-checkpoint-tool), record how much of the process's
# memory is on huge pages after the checkpoint, and ask the pattern to check itself.
# Writes OUTDIR/driver-thp-GIB.json.
set -euo pipefail
OUT=${1:?OUTDIR}; GIB=${2:-4}; MODES=${3:-"madvise always"}
BUILD=${BUILD:-build}
TOOL=$BUILD/bench/cuda-checkpoint-tool
THP=/sys/kernel/mm/transparent_hugepage/enabled
mkdir -p "$OUT"
was=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP")
PID=
cleanup() {
  [[ -n $PID ]] && kill -9 "$PID" 2>/dev/null || true
  echo "$was" >"$THP" || true
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { python3 -c 'import sys,time; print(f"{time.time()-float(sys.argv[1]):.3f}")' "$1"; }
ask() { exec 3<>"/dev/tcp/127.0.0.1/$1"; printf '%s\n' "$2" >&3; IFS= read -r r <&3; exec 3>&-; printf '%s' "$r"; }
rows=()
for mode in $MODES; do
  echo "$mode" >"$THP"
  ready=$(mktemp -u /tmp/thp-ready.XXXXXX)
  "$BUILD/tests/cuda_pattern" --gib "$GIB" --ready-file "$ready" >/dev/null 2>&1 &
  PID=$!
  until [[ -s $ready ]]; do sleep 0.05; kill -0 "$PID"; done
  port=$(cat "$ready")
  t=$(now); "$TOOL" lock "$PID"; lock=$(since "$t")
  t=$(now); "$TOOL" checkpoint "$PID"; ckpt=$(since "$t")
  huge_kib=$(awk '/AnonHugePages/ {print $2}' "/proc/$PID/smaps_rollup")
  rss_kib=$(awk '/^Rss/ {print $2}' "/proc/$PID/smaps_rollup")
  t=$(now); "$TOOL" restore "$PID"; "$TOOL" unlock "$PID"; rest=$(since "$t")
  answer=$(ask "$port" CHECK)
  kill -9 "$PID"; wait "$PID" 2>/dev/null || true; PID=
  rows+=("{\"thp\": \"$mode\", \"lock_s\": $lock, \"checkpoint_s\": $ckpt, \"restore_unlock_s\": $rest, \"rss_kib\": $rss_kib, \"anon_huge_kib\": $huge_kib, \"answer\": \"$answer\"}")
  echo "${rows[-1]}"
done
( IFS=,; echo "{\"gib\": $GIB, \"kernel\": \"$(uname -r)\", \"thp_found\": \"$was\", \"runs\": [${rows[*]}]}" ) >"$OUT/driver-thp-$GIB.json"
