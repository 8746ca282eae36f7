#!/usr/bin/env bash
# gpusnap push/pull against an OCI registry, side by side in one run with `skopeo copy` moving
# the same bytes to and from the same registry, and with the registry disk's own read rate.
# Also the dedup of a second capture of the same workload. Root (CRIU); needs docker-registry
# and skopeo (scripts/install-deps).
#
#   BUILD=build bench/store_registry_bench.sh OUTDIR [MIB] [DEDUP_MIB]
#
# MIB (default 4096): memory of the captured test workload; DEDUP_MIB (default 512): memory of
# the two workloads of the dedup measurement. Writes OUTDIR/results.md and the raw JSON.
set -euo pipefail
OUT=${1:?usage: store_registry_bench.sh OUTDIR [MIB] [DEDUP_MIB]}
MIB=${2:-4096}
DEDUP_MIB=${3:-512}
BUILD=${BUILD:-build}
GPUSNAP=$(readlink -f "$BUILD/gpusnap")
WORKLOAD=$(readlink -f "$BUILD/tests/gpusnap-test-workload")
mkdir -p "$OUT"
OUT=$(readlink -f "$OUT")
cd "$OUT"
rm -rf wl-* registry art art2 dedup-a dedup-b layout pulled skopeo-pulled cache store
PORT=$((20000 + RANDOM % 20000))

cat >registry.yml <<YML
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $OUT/registry
http:
  addr: 127.0.0.1:$PORT
  secret: bench
YML
docker-registry serve registry.yml >registry.log 2>&1 &
REG_PID=$!
WL_PIDS=()
cleanup() {
  kill "$REG_PID" 2>/dev/null || true
  for p in "${WL_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/v2/" >/dev/null && break; sleep 0.1; done

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc; }
rate() { echo "scale=1; $1 / $2 / 1000000" | bc; }  # bytes seconds -> MB/s

# A capture of the test workload holding MIB of memory with a fixed seed.
capture() {  # NAME MIB SEED
  mkdir -p "wl-$1"
  setsid "$WORKLOAD" --mib "$2" --seed "$3" --children 0 --ready-file "wl-$1/ready" \
    </dev/null >"wl-$1/log" 2>&1 &
  local pid=$!  # setsid execs in place: the shell's background child is not a group leader
  WL_PIDS+=("$pid")
  for _ in $(seq 600); do [[ -f wl-$1/ready ]] && break; sleep 0.1; done
  "$GPUSNAP" checkpoint --pid "$pid" -o "$1" -q
}

echo "bench: load $(cut -d' ' -f1-3 /proc/loadavg); capturing ${MIB} MiB" >&2
capture art "$MIB" 1
BYTES=$(du -sb --apparent-size art | cut -f1)

# The same bytes as an OCI image layout for skopeo: one uncompressed layer per artifact file.
mkdir -p layout/blobs/sha256
layers=""
for f in $(cd art && find . -type f | sort); do
  d=$(sha256sum "art/$f" | cut -d' ' -f1)
  ln -f "art/$f" "layout/blobs/sha256/$d" 2>/dev/null || cp "art/$f" "layout/blobs/sha256/$d"
  s=$(stat -c %s "art/$f")
  layers+="${layers:+,}{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:$d\",\"size\":$s}"
done
cfg='{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
cd_=$(printf %s "$cfg" | sha256sum | cut -d' ' -f1)
printf %s "$cfg" >"layout/blobs/sha256/$cd_"
man="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$cd_\",\"size\":${#cfg}},\"layers\":[$layers]}"
md=$(printf %s "$man" | sha256sum | cut -d' ' -f1)
printf %s "$man" >"layout/blobs/sha256/$md"
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%d,"annotations":{"org.opencontainers.image.ref.name":"a"}}]}' "$md" ${#man} >layout/index.json
echo '{"imageLayoutVersion":"1.0.0"}' >layout/oci-layout

sync
echo "bench: push" >&2
t0=$(now); "$GPUSNAP" push art "oci://127.0.0.1:$PORT/bench/gpusnap:a" --plain-http --json -q >push.json; t1=$(now)
PUSH_S=$(secs "$t0" "$t1")
echo "bench: skopeo copy (push)" >&2
t0=$(now); skopeo copy -q --dest-tls-verify=false oci:layout:a "docker://127.0.0.1:$PORT/bench/skopeo:a" >skopeo-push.log 2>&1; t1=$(now)
SKOPEO_PUSH_S=$(secs "$t0" "$t1")

# The registry disk's own read rate: its largest blob, O_DIRECT (no page cache).
BIG=$(find registry -name data -type f -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2)
BIG_BYTES=$(stat -c %s "$BIG")
t0=$(now); dd if="$BIG" of=/dev/null bs=8M iflag=direct status=none; t1=$(now)
DISK_S=$(secs "$t0" "$t1")

sync; echo 3 >/proc/sys/vm/drop_caches
echo "bench: pull" >&2
t0=$(now); "$GPUSNAP" pull "oci://127.0.0.1:$PORT/bench/gpusnap:a" -o pulled --cache cache --plain-http --json -q >pull.json; t1=$(now)
PULL_S=$(secs "$t0" "$t1")
sync; echo 3 >/proc/sys/vm/drop_caches
echo "bench: skopeo copy (pull)" >&2
t0=$(now); skopeo copy -q --src-tls-verify=false "docker://127.0.0.1:$PORT/bench/skopeo:a" oci:skopeo-pulled:a >skopeo-pull.log 2>&1; t1=$(now)
SKOPEO_PULL_S=$(secs "$t0" "$t1")
cmp -s art/criu/pages-1.img pulled/criu/pages-1.img || { echo "bench: pulled artifact differs" >&2; exit 1; }
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
  echo "| | seconds | MB/s of the artifact's $BYTES bytes |"
  echo "| --- | --- | --- |"
  echo "| gpusnap push | $PUSH_S | $(rate "$BYTES" "$PUSH_S") |"
  echo "| skopeo copy oci: -> registry | $SKOPEO_PUSH_S | $(rate "$BYTES" "$SKOPEO_PUSH_S") |"
  echo "| gpusnap pull (empty cache, page cache dropped) | $PULL_S | $(rate "$BYTES" "$PULL_S") |"
  echo "| skopeo copy registry -> oci: (page cache dropped) | $SKOPEO_PULL_S | $(rate "$BYTES" "$SKOPEO_PULL_S") |"
  echo "| registry disk, dd iflag=direct of its largest blob ($BIG_BYTES bytes) | $DISK_S | $(rate "$BIG_BYTES" "$DISK_S") |"
  echo
  echo "push: $(jq -c '{chunks, chunks_uploaded, bytes_uploaded, stored_bytes, phases}' push.json)"
  echo "pull: $(jq -c '{chunks, chunks_fetched, bytes_fetched, phases}' pull.json)"
  echo "dedup: second capture of ${DEDUP_MIB} MiB adds $NEW of $STORED stored bytes ($(echo "scale=2; 100 * $NEW / $STORED" | bc) %)"
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee results.md
