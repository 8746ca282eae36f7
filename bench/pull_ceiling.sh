#!/usr/bin/env bash
# shellcheck disable=SC2154  # REG_PID_<name> is set by start_registry (printf -v) in store_registry_lib.sh
# How close `gpusnap pull` gets to what the registry can serve, and at which --jobs: in one run,
# the registry's ceiling measured by a client that is not gpusnap (bench/fetch_blobs.py: every
# blob with 8, 32 and 64 threads, bytes dropped), `skopeo copy` to a directory, and gpusnap pull
# with --jobs 8, 16, 32, 64 and its default, each into an empty cache and output.
#
#   bench/run pull-ceiling OUTDIR [MIB]
#
# MIB (default 4096): memory of the captured test workload. REG_STORAGE=DIR puts the registry's
# storage there (a tmpfs takes the disk out; default OUTDIR/registry); PULL_DIR=DIR the pulls'
# outputs (default OUTDIR). DROP_CACHES=1 drops the page cache before each transfer (the
# registry then reads its disk). Writes OUTDIR/results.md. Root (CRIU); docker-registry and
# skopeo from scripts/install-deps.
set -euo pipefail
OUT=${1:?usage: pull_ceiling.sh OUTDIR [MIB]}
MIB=${2:-4096}
BUILD=${BUILD:-build}
GPUSNAP=$(readlink -f "$BUILD/gpusnap")
# shellcheck disable=SC2034  # WORKLOAD and REGISTRY are read by store_registry_lib.sh
WORKLOAD=$(readlink -f "$BUILD/tests/gpusnap-test-workload")
# shellcheck disable=SC2034
REGISTRY=$(command -v docker-registry)
HERE=$(dirname "$(readlink -f "$0")")
source "$HERE/store_registry_lib.sh"
mkdir -p "$OUT"
OUT=$(readlink -f "$OUT")
cd "$OUT"
STORAGE=${REG_STORAGE:-$OUT/registry}
PULLS=${PULL_DIR:-$OUT}
rm -rf wl-* art "$STORAGE" "$PULLS/pulled" "$PULLS/skopeo" "$PULLS/cache"
mkdir -p "$PULLS"
PORT=$((20000 + RANDOM % 20000))
trap store_bench_cleanup EXIT
# Progress on stderr as it goes: a run cut short by its caller's bound still says where it was.
say() { echo "pull-ceiling $(date -u +%T): $*" >&2; }
start_registry main "$PORT" "$STORAGE"
sample_load

say "capturing a $MIB MiB workload"
capture art "$MIB" 1
say "pushing $(du -sh --apparent-size art | cut -f1)"
BYTES=$(du -sb --apparent-size art | cut -f1)
REF="oci://127.0.0.1:$PORT/bench/pull:a"
"$GPUSNAP" push art "$REF" --plain-http --json -q >push.json
STORED=$(jq .stored_bytes push.json)
rm -rf art

drop() { sync; [[ ${DROP_CACHES:-0} == 1 ]] && echo 3 >/proc/sys/vm/drop_caches; true; }
CEILING=0
LINES=()
for threads in 8 32 64; do
  drop
  say "fetch_blobs.py with $threads threads"
  read -r got s blobs < <(python3 "$HERE/fetch_blobs.py" "127.0.0.1:$PORT" bench/pull a "$threads")
  r=$(rate "$got" "$s")
  LINES+=("| registry ceiling: fetch_blobs.py, $threads threads ($blobs blobs) | $s | $r | |")
  CEILING=$(awk -v a="$CEILING" -v b="$r" 'BEGIN { print (b > a ? b : a) }')
done
drop
say "skopeo copy"
t0=$(now)
skopeo copy -q --src-tls-verify=false "docker://127.0.0.1:$PORT/bench/pull:a" "dir:$PULLS/skopeo"
t1=$(now)
s=$(secs "$t0" "$t1")
LINES+=("| skopeo copy docker:// -> dir: | $s | $(rate "$STORED" "$s") | |")
rm -rf "$PULLS/skopeo"
for jobs in 8 16 32 64 default; do
  rm -rf "$PULLS/pulled" "$PULLS/cache"
  drop
  flag=(--jobs "$jobs")
  [[ $jobs == default ]] && flag=()
  t0=$(now)
  "$GPUSNAP" pull "$REF" -o "$PULLS/pulled" --cache "$PULLS/cache" --plain-http -q "${flag[@]}"
  t1=$(now)
  s=$(secs "$t0" "$t1")
  r=$(rate "$STORED" "$s")
  say "gpusnap pull --jobs $jobs: $s s"
  LINES+=("| gpusnap pull --jobs $jobs | $s | $r | $(awk -v r="$r" -v c="$CEILING" 'BEGIN { printf "%.0f %%", 100 * r / c }') |")
done
rm -rf "$PULLS/pulled" "$PULLS/cache"

{
  echo "snapshot: $BYTES bytes, $STORED stored; registry storage $STORAGE; drop caches ${DROP_CACHES:-0}"
  echo
  echo "| | seconds | MB/s of the stored bytes | of the ceiling |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${LINES[@]}"
  echo
  echo "load average during the run (1-minute, every 5 s): $(load_summary)"
} | tee results.md
