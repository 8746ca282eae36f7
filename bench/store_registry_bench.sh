#!/usr/bin/env bash
# shellcheck disable=SC2154  # REG_PID_<name> is set by start_registry (printf -v) in store_registry_lib.sh
# gpusnap push/pull against an OCI registry, side by side in one run with `skopeo copy` moving
# the same bytes to and from the same registry, and with the registry disk's own read rate.
# Also the dedup of a second capture of the same workload. Root (CRIU); needs docker-registry
# and skopeo (scripts/install-deps).
#
#   bench/run store-registry OUTDIR [MIB] [DEDUP_MIB]
#
# MIB (default 4096): memory of the captured test workload; DEDUP_MIB (default 512): memory of
# the two workloads of the dedup measurement. BASELINE=PATH (optional): another gpusnap binary
# (an older build) whose push and pull run in the same run against a second registry of its
# own, so that the two are compared under the same load. Writes OUTDIR/results.md and the raw
# JSON. For every transfer it records the client's and the registry's CPU seconds (the
# registry's from /proc/PID/stat), and the load average every 5 s (loadavg.log): on a shared
# machine the load says what share of the cores each side had. Its registry, capture and
# timing parts are in store_registry_lib.sh. NODE_RUN=DIR (optional, e.g. a huge-page
# tmpfs): adds pulls into the node's copy under DIR, as restore oci:// makes it (see below).
set -euo pipefail
OUT=${1:?usage: store_registry_bench.sh OUTDIR [MIB] [DEDUP_MIB]}
MIB=${2:-4096}
DEDUP_MIB=${3:-512}
BUILD=${BUILD:-build}
GPUSNAP=$(readlink -f "$BUILD/gpusnap")
# shellcheck disable=SC2034  # WORKLOAD and REGISTRY are read by store_registry_lib.sh
WORKLOAD=$(readlink -f "$BUILD/tests/gpusnap-test-workload")
# shellcheck disable=SC2034
REGISTRY=$(command -v docker-registry)
source "$(dirname "$(readlink -f "$0")")/store_registry_lib.sh"
mkdir -p "$OUT"
OUT=$(readlink -f "$OUT")
cd "$OUT"
rm -rf wl-* registry registry-base art art2 dedup-a dedup-b layout pulled pulled-base skopeo-pulled cache cache-base store
PORT=$((20000 + RANDOM % 20000))
trap store_bench_cleanup EXIT
start_registry main "$PORT" "$OUT/registry"
BASE_PORT=$((PORT + 1))
[[ -n ${BASELINE:-} ]] && start_registry base "$BASE_PORT" "$OUT/registry-base"
sample_load

echo "bench: load $(cut -d' ' -f1-3 /proc/loadavg); capturing ${MIB} MiB" >&2
capture art "$MIB" 1
BYTES=$(du -sb --apparent-size art | cut -f1)
oci_layout art layout

sync
measure "gpusnap push" "$REG_PID_main" \
  "$GPUSNAP" push art "oci://127.0.0.1:$PORT/bench/gpusnap:a" --plain-http --json -q >push.json
if [[ -n ${BASELINE:-} ]]; then
  measure "gpusnap push (baseline build)" "$REG_PID_base" \
    "$BASELINE" push art "oci://127.0.0.1:$BASE_PORT/bench/gpusnap:a" --plain-http --json -q >push-base.json
fi
measure "skopeo copy oci: -> registry" "$REG_PID_main" \
  skopeo copy -q --dest-tls-verify=false oci:layout:a "docker://127.0.0.1:$PORT/bench/skopeo:a"

# The registry disk's own read rate: its largest blob, O_DIRECT (no page cache).
BIG=$(find registry -name data -type f -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2)
BIG_BYTES=$(stat -c %s "$BIG")
t0=$(now); dd if="$BIG" of=/dev/null bs=8M iflag=direct status=none; t1=$(now)
DISK_S=$(secs "$t0" "$t1")

sync; echo 3 >/proc/sys/vm/drop_caches
measure "gpusnap pull (empty cache, page cache dropped)" "$REG_PID_main" \
  "$GPUSNAP" pull "oci://127.0.0.1:$PORT/bench/gpusnap:a" -o pulled --cache cache --plain-http --json -q >pull.json
if [[ -n ${BASELINE:-} ]]; then
  sync; echo 3 >/proc/sys/vm/drop_caches
  measure "gpusnap pull (baseline build; empty cache, page cache dropped)" "$REG_PID_base" \
    "$BASELINE" pull "oci://127.0.0.1:$BASE_PORT/bench/gpusnap:a" -o pulled-base --cache cache-base --plain-http --json -q >pull-base.json
  cmp -s art/criu/pages-1.img pulled-base/criu/pages-1.img || { echo "bench: pulled artifact differs" >&2; exit 1; }
  rm -rf pulled-base cache-base
fi
sync; echo 3 >/proc/sys/vm/drop_caches
measure "skopeo copy registry -> oci: (page cache dropped)" "$REG_PID_main" \
  skopeo copy -q --src-tls-verify=false "docker://127.0.0.1:$PORT/bench/skopeo:a" oci:skopeo-pulled:a
cmp -s art/criu/pages-1.img pulled/criu/pages-1.img || { echo "bench: pulled artifact differs" >&2; exit 1; }

# The node's copy, as `restore oci://` and the agent write it (RUN_DIR/pulled/DIGEST), with
# RUN_DIR on NODE_RUN (optional: a tmpfs, a huge-page one where restore maps host images from):
# this build writes each uncompressed chunk once, into the copy; the baseline build (whose
# restore oci:// writes the same copy through `pull -o`) writes it into the cache too. The
# cache is on this folder's filesystem. NODE_ROUNDS rounds (2), the two builds alternating.
NODE_ROWS=()
if [[ -n ${NODE_RUN:-} ]]; then
  for round in $(seq "${NODE_ROUNDS:-2}"); do
    rm -rf "$NODE_RUN/new" "$NODE_RUN/base" cache-node cache-node-base
    sync; echo 3 >/proc/sys/vm/drop_caches
    measure "gpusnap pull into the node copy on NODE_RUN (round $round)" "$REG_PID_main" \
      "$GPUSNAP" pull "oci://127.0.0.1:$PORT/bench/gpusnap:a" --run-dir "$NODE_RUN/new" --cache cache-node \
      --plain-http --json -q >"node-pull-$round.json"
    copy=$(jq -r .artifact "node-pull-$round.json")
    cmp -s art/criu/pages-1.img "$copy/criu/pages-1.img" || { echo "bench: node copy differs" >&2; exit 1; }
    NODE_ROWS+=("round $round, this build: cache $(du -sb cache-node | cut -f1) bytes, copy $(du -sb "$copy" | cut -f1) bytes")
    if [[ -n ${BASELINE:-} ]]; then
      mkdir -p "$NODE_RUN/base/pulled"
      sync; echo 3 >/proc/sys/vm/drop_caches
      measure "gpusnap pull into the node copy on NODE_RUN (baseline build, round $round)" "$REG_PID_base" \
        "$BASELINE" pull "oci://127.0.0.1:$BASE_PORT/bench/gpusnap:a" -o "$NODE_RUN/base/pulled/copy" \
        --cache cache-node-base --plain-http --json -q >"node-pull-base-$round.json"
      cmp -s art/criu/pages-1.img "$NODE_RUN/base/pulled/copy/criu/pages-1.img" || { echo "bench: node copy differs" >&2; exit 1; }
      NODE_ROWS+=("round $round, baseline build: cache $(du -sb cache-node-base | cut -f1) bytes, copy $(du -sb "$NODE_RUN/base/pulled/copy" | cut -f1) bytes")
    fi
  done
  rm -rf "$NODE_RUN/new" "$NODE_RUN/base" cache-node cache-node-base
fi
rm -rf pulled skopeo-pulled layout art cache

echo "bench: dedup, two captures of ${DEDUP_MIB} MiB" >&2
capture dedup-a "$DEDUP_MIB" 7
capture dedup-b "$DEDUP_MIB" 7
"$GPUSNAP" import dedup-a --cache store --json -q >import-a.json
"$GPUSNAP" import dedup-b --cache store --json -q >import-b.json
NEW=$(jq .new_bytes import-b.json)
STORED=$(jq .stored_bytes import-b.json)
rm -rf dedup-a dedup-b store

{
  results_table "$BYTES"
  echo "| registry disk, dd iflag=direct of its largest blob ($BIG_BYTES bytes) | $DISK_S | $(rate "$BIG_BYTES" "$DISK_S") | | |"
  echo
  echo "push: $(jq -c '{chunks, chunks_uploaded, bytes_uploaded, stored_bytes, phases}' push.json)"
  echo "pull: $(jq -c '{chunks, chunks_fetched, bytes_fetched, phases}' pull.json)"
  for row in "${NODE_ROWS[@]}"; do echo "node copy: $row"; done
  echo "dedup: second capture of ${DEDUP_MIB} MiB adds $NEW of $STORED stored bytes ($(awk -v n="$NEW" -v s="$STORED" 'BEGIN { printf "%.2f", 100 * n / s }') %)"
  echo "load average during the run (1-minute, every 5 s): $(load_summary); after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee results.md
