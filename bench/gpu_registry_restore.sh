#!/usr/bin/env bash
# A GPU snapshot restored on a node that never saw it, from a registry on the same machine, into
# an empty node cache: pull alone, restore alone (from the pulled artifact) and the overlapped
# `gpusnap restore oci://...`, side by side in one run, each restore timed to the first correct
# answer of the copy. The snapshot: the CUDA pattern workload (tests/cuda_pattern --gib GIB,
# started with libgpusnap-preload.so), captured --leave-running into a huge-page tmpfs and
# pushed. The registry keeps its storage on the local disk, and the page cache is dropped before
# each pull.
#
#   bench/run gpu-registry-restore OUTDIR [GIB] (root; default GIB 16)
#
# BIN: the folder with gpusnap, libgpusnap-preload.so and tests/cuda_pattern (default build).
# REGISTRY: the docker-registry binary (default: docker-registry on PATH; on a machine where
# nothing can be installed, carry /usr/bin/docker-registry: it needs only libc). STORE: the
# tmpfs mount point (default /mnt/gpusnap-store, mounted huge=within_size when it is not a
# mount). REGDIR: the registry's folder on disk (default /var/tmp/gpusnap-bench-registry).
# GPUSNAP_CRIU: CRIU. Results: OUTDIR/run.log, written as it goes, and each command's JSON.
set -uo pipefail
OUT=${1:?OUTDIR}; GIB=${2:-16}
BIN=${BIN:-build}; G=$BIN/gpusnap
REGISTRY=${REGISTRY:-$(command -v docker-registry)}
STORE=${STORE:-/mnt/gpusnap-store}
REGDIR=${REGDIR:-/var/tmp/gpusnap-bench-registry}
mkdir -p "$OUT" "$STORE" "$REGDIR"
exec > >(tee -a "$OUT/run.log") 2>&1
mountpoint -q "$STORE" || mount -t tmpfs -o huge=within_size,size=$(( GIB * 3 + 8 ))g gpusnap-store "$STORE"
REGPID=""; SRC=""
cleanup() {
  [[ -n $SRC ]] && kill -9 "$SRC" 2>/dev/null
  [[ -n $REGPID ]] && kill "$REGPID" 2>/dev/null
  [[ -n ${W:-} ]] && rm -rf "$W"
  rm -rf "$REGDIR" "$STORE/bench-snap" "$STORE/bench-pulled" "$STORE"/bench-cache-* "$STORE/bench-run"
}
trap cleanup EXIT
el() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$(date +%s.%N)"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
ask() { timeout 60 bash -c 'exec 3<>/dev/tcp/127.0.0.1/$1; printf "%s\n" "$2" >&3; IFS= read -r r <&3; printf "%s" "$r"' _ "$1" "$2"; }

printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s/storage\nhttp:\n  addr: 127.0.0.1:5123\n  secret: bench\n' "$REGDIR" >"$REGDIR/config.yml"
"$REGISTRY" serve "$REGDIR/config.yml" >"$OUT/registry.log" 2>&1 & REGPID=$!
W=$(mktemp -d)
setsid env LD_PRELOAD="$BIN/libgpusnap-preload.so" "$BIN/tests/cuda_pattern" --gib "$GIB" \
  --ready-file "$W/ready" </dev/null >"$W/workload.log" 2>&1 & SRC=$!
for _ in $(seq 600); do [[ -s $W/ready ]] && break; sleep 0.1; done
PORT=$(cat "$W/ready"); BEFORE=$(ask "$PORT" CHECK)
echo "== source: $BEFORE"
timeout 300 "$G" checkpoint -p "$SRC" -o "$STORE/bench-snap" --leave-running --json >"$OUT/checkpoint.json" 2>"$OUT/checkpoint.err"
echo "== checkpoint rc=$? $(field "$OUT/checkpoint.json" "['seconds']" 2>/dev/null) s"
REF=oci://127.0.0.1:5123/gpusnap/bench:$GIB
t=$(date +%s.%N)
timeout 600 "$G" push "$STORE/bench-snap" "$REF" --plain-http --json >"$OUT/push.json" 2>"$OUT/push.err"
echo "== push rc=$? $(el "$t") s; artifact $(du -sb "$STORE/bench-snap" | cut -f1) bytes, registry $(du -sb "$REGDIR/storage" | cut -f1) bytes"

restore_check() {  # NAME ARTIFACT-OR-REFERENCE [FLAGS...]: restore one copy, time it to its first correct answer
  local name=$1 what=$2; shift 2
  local t; t=$(date +%s.%N)
  timeout 300 "$G" restore "$what" --publish "$PORT" --json --run-dir "$STORE/bench-run" "$@" \
    >"$OUT/$name.json" 2>"$OUT/$name.err"
  local rc=$? cmd; cmd=$(el "$t")
  local answer; answer=$(ask "$(field "$OUT/$name.json" "['copies'][0]['ports'][0]['host_port']" 2>/dev/null)" CHECK)
  echo "== $name: rc=$rc, command ${cmd} s, first correct answer $(el "$t") s: $answer"
  [[ $answer == "$BEFORE" ]] || echo "== $name: THE COPY DIFFERS"
  kill -9 "$(field "$OUT/$name.json" "['copies'][0]['init_pid']" 2>/dev/null)" 2>/dev/null
  sleep 2
}
sync; echo 3 >/proc/sys/vm/drop_caches
t=$(date +%s.%N)
timeout 600 "$G" pull "$REF" -o "$STORE/bench-pulled" --plain-http --cache "$STORE/bench-cache-a" --json \
  >"$OUT/pull.json" 2>"$OUT/pull.err"
echo "== pull alone (empty node cache): rc=$? $(el "$t") s"
restore_check restore-alone "$STORE/bench-pulled"
rm -rf "$STORE/bench-pulled" "$STORE/bench-cache-a" "$STORE/bench-run"
sync; echo 3 >/proc/sys/vm/drop_caches
restore_check restore-overlapped "$REF" --plain-http --cache "$STORE/bench-cache-b"
