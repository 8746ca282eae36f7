#!/usr/bin/env bash
# Capture into a RAM store (a tmpfs mounted huge=within_size), the copying path against the
# direct path (the driver writes the GPU memory straight into the artifact), side by side on one
# CUDA workload per size, started with libgpusnap-preload.so as `gpusnap run` starts workloads:
# capture time, the driver's call, and host memory in use sampled every 100 ms. Then a restore
# of the direct artifact (its peak too) and, at the first size, a capture refused for want of
# store space (exit 10).
#
#   bench/run gpu-direct-host-images OUTDIR GIB...
#
# BIN: the folder holding gpusnap, libgpusnap-preload.so and tests/cuda_pattern (default build).
# STORE: where the store is mounted (default /mnt/gpusnap-store). BUDGET: seconds; a size whose
# run would not fit in what is left is skipped (default: no limit). GPUSNAP_CRIU: CRIU.
# LEAVE_RUNNING=0: each capture stops its source, as a plain `gpusnap checkpoint` does (one fresh
# workload per capture, no restore); the files are then named cp-GIB-MODE-stop.json and so on.
# REFUSAL=0: no refusal. MODES: the paths to run (default "copy direct"). NO_MOUNT=1: STORE is a
# plain directory (a store on disk) instead of a huge-page tmpfs mounted there.
# Results: OUTDIR/cp-GIB-MODE.json, mem-GIB-MODE.tsv, and report.md (bench/direct_host_images_report.py).
set -uo pipefail
OUTDIR=${1:?OUTDIR}; shift
BIN=${BIN:-build}
STORE=${STORE:-/mnt/gpusnap-store}
HERE=$(cd "$(dirname "$0")" && pwd)
T0=$(date +%s)
left() { [[ -z ${BUDGET:-} ]] && echo 99999 || echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "== $(date -u +%T) $*"; }
ask() {  # PORT COMMAND
  timeout 60 bash -c 'exec 3<>/dev/tcp/127.0.0.1/$1; printf "%s\n" "$2" >&3; IFS= read -r r <&3; printf "%s" "$r"' _ "$1" "$2"
}
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
SAMPLER=""
sample() { python3 "$HERE/meminfo_sampler.py" "$1" & SAMPLER=$!; sleep 0.3; }
unsample() { sleep 0.3; kill "$SAMPLER"; wait "$SAMPLER" 2>/dev/null; SAMPLER=""; }
SRC=""
cleanup() {
  [[ -n $SAMPLER ]] && kill "$SAMPLER" 2>/dev/null
  [[ -n $SRC ]] && kill -9 "$SRC" 2>/dev/null
  rm -rf "$STORE"/snap-*
}
trap cleanup EXIT

mkdir -p "$STORE" "$OUTDIR"
(( ${NO_MOUNT:-0} )) || mountpoint -q "$STORE" || mount -t tmpfs -o "huge=within_size,size=${STORE_GIB:-115}g" gpusnap-store "$STORE"
first=${REFUSAL:-1}
LEAVE=${LEAVE_RUNNING:-1}
start_workload() {  # GIB: SRC, PORT, before, W
  W=$(mktemp -d)
  setsid env LD_PRELOAD="$BIN/libgpusnap-preload.so" "$BIN/tests/cuda_pattern" --gib "$1" \
    --ready-file "$W/ready" </dev/null >"$W/workload.log" 2>&1 &
  SRC=$!
  for _ in $(seq 600); do [[ -s $W/ready ]] && break; sleep 0.1; done
  PORT=$(cat "$W/ready")
  before=$(ask "$PORT" CHECK)
  log "$1 GiB workload $SRC ready: $before"
}
stop_workload() {
  kill -9 "$SRC" 2>/dev/null; wait "$SRC" 2>/dev/null; SRC=""
  rm -rf "$W"
  sleep 2  # the GPU's memory back before the next workload
}
for gib in "$@"; do
  # Start, two captures and a restore: about 2 s per GiB on the H200, and 20 s more; a start
  # per capture without --leave-running.
  need=$(( gib * 2 + 20 ))
  if (( $(left) < need )); then log "skip $gib GiB: $(left) s left, ~$need s needed"; continue; fi
  (( LEAVE )) && start_workload "$gib"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  for mode in ${MODES:-copy direct}; do
    flag=(); [[ $mode == copy ]] && flag=(--no-direct-host-images)
    name=$gib-$mode
    if (( LEAVE )); then flag+=(--leave-running); else name=$name-stop; start_workload "$gib"; fi
    sample "$OUTDIR/mem-$name.tsv"
    timeout 300 "$BIN/gpusnap" checkpoint -p "$SRC" -o "$STORE/snap-$gib-$mode" --json \
      "${flag[@]}" >"$OUTDIR/cp-$name.json" 2>"$OUTDIR/cp-$name.err"
    rc=$?
    unsample
    du -sh "$STORE/snap-$gib-$mode" 2>/dev/null
    if (( ! LEAVE )); then
      log "$gib GiB $mode, source stopped: rc=$rc $(field "$OUTDIR/cp-$name.json" "['seconds']" 2>/dev/null) s"
      rm -rf "$STORE/snap-$gib-$mode"
      stop_workload
      continue
    fi
    after=$(ask "$PORT" CHECK)
    log "$gib GiB $mode: rc=$rc $(field "$OUTDIR/cp-$name.json" "['seconds']" 2>/dev/null) s; source after: $after"
    [[ $after == "$before" ]] || log "SOURCE CHANGED: $after"
    if [[ $mode == direct && $rc == 0 ]]; then
      sample "$OUTDIR/mem-$gib-restore.tsv"
      "$BIN/gpusnap" restore "$STORE/snap-$gib-$mode" --publish "$PORT" --json \
        >"$OUTDIR/rs-$gib.json" 2>"$OUTDIR/rs-$gib.err"
      rrc=$?
      unsample
      if [[ $rrc == 0 ]]; then
        copy=$(ask "$(field "$OUTDIR/rs-$gib.json" "['copies'][0]['ports'][0]['host_port']")" CHECK)
        log "$gib GiB restore: $(field "$OUTDIR/rs-$gib.json" "['seconds']") s; copy: $copy"
        [[ $copy == "$before" ]] || log "COPY DIFFERS: $copy"
        kill -9 "$(field "$OUTDIR/rs-$gib.json" "['copies'][0]['init_pid']")" 2>/dev/null
      else
        log "$gib GiB restore failed rc=$rrc: $(tail -2 "$OUTDIR/rs-$gib.err")"
      fi
    fi
    rm -rf "$STORE/snap-$gib-$mode"
  done
  if (( first && LEAVE )); then
    # A store too small for the GPU memory: refused before anything is frozen.
    first=0
    mkdir -p "$STORE-small"
    mountpoint -q "$STORE-small" || mount -t tmpfs -o size=1g gpusnap-small "$STORE-small"
    "$BIN/gpusnap" checkpoint -p "$SRC" -o "$STORE-small/snap" >"$OUTDIR/refusal.out" 2>&1
    log "refusal: exit $? ($(cat "$OUTDIR/refusal.out")); source after: $(ask "$PORT" CHECK)"
    umount "$STORE-small"
  fi
  (( LEAVE )) && stop_workload
done
python3 "$HERE/direct_host_images_report.py" "$OUTDIR" | tee "$OUTDIR/report.md"
