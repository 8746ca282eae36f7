#!/usr/bin/env bash
# shellcheck disable=SC2154  # REG_PID_<name> is set by start_registry (printf -v) in store_registry_lib.sh
# gpusnap push/pull against a docker-registry on loopback, side by side in one run with
# `skopeo copy` moving the same bytes, on a machine where nothing can be installed and nothing
# outside can be reached (the GPU machine): every binary comes from a folder of carried files.
# The artifact is a CPU capture of the test workload (no GPU is used).
#
# The carried folder (about 18 MiB; CRIU is carried apart), made on the development machine
# from a build, by this script itself:
#   BUILD=build bench/store_registry_h200.sh --pack /work/main/.carry/h16b
# which writes into the folder:
#   gpusnap.gz                     build/gpusnap, stripped, gzip -9
#   gpusnap-test-workload          build/tests/gpusnap-test-workload, stripped
#   docker-registry.gz             /usr/bin/docker-registry (Go; needs only libc), gzip -9
#   skopeo.gz                      /usr/bin/skopeo, gzip -9
#   lib/                           the shared libraries `ldd /usr/bin/skopeo` names but glibc's
#                                  (libgpgme, libassuan, libgpg-error, libdevmapper, libselinux,
#                                  libudev, libpcre2-8: Debian 12's, as on that machine), used
#                                  through LD_LIBRARY_PATH by skopeo alone
#   policy.json                    skopeo's trust policy (none exists there): accept anything
#   store_registry_h200.sh, store_registry_lib.sh
# gzip because it is on every Debian; the binaries are unpacked into WORK at the start.
#
# On the GPU machine, from the checkout with the folders carried (.carry/criu holds CRIU):
#   GPUSNAP_CRIU=$PWD/.carry/criu/criu bash .carry/h16b/store_registry_h200.sh "$OUT" [MIB]
# OUT: where the log (run.log, written as it goes) and results.md go. MIB (default 4096): the
# test workload's memory. Environment: CARRY (default: this script's folder), WORK (default
# /tmp/gpusnap-store-h200; needs about 5 x MIB of disk), JOBS (gpusnap's chunks in flight,
# default 8), BUDGET_S (default 290: every step is bounded with `timeout` to end within it).
# Root (CRIU).
set -uo pipefail

HERE=$(dirname "$(readlink -f "$0")")

if [[ ${1:-} == --pack ]]; then
  DEST=${2:?usage: store_registry_h200.sh --pack DIR}
  BUILD=${BUILD:-build}
  set -e
  mkdir -p "$DEST/lib"
  strip -o "$DEST/gpusnap" "$BUILD/gpusnap"
  gzip -9 -f "$DEST/gpusnap"
  strip -o "$DEST/gpusnap-test-workload" "$BUILD/tests/gpusnap-test-workload"
  gzip -9 -c "$(command -v docker-registry)" >"$DEST/docker-registry.gz"
  gzip -9 -c "$(command -v skopeo)" >"$DEST/skopeo.gz"
  ldd "$(command -v skopeo)" | awk '$3 ~ /^\// {print $3}' |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
    while read -r so; do cp -L "$so" "$DEST/lib/"; done
  echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$DEST/policy.json"
  cp "$HERE/store_registry_h200.sh" "$HERE/store_registry_lib.sh" "$DEST/"
  du -sh "$DEST"
  exit 0
fi

LOG=${1:?usage: store_registry_h200.sh OUTDIR [MIB]   (or --pack DIR)}
MIB=${2:-4096}
CARRY=$(readlink -f "${CARRY:-$HERE}")
WORK=${WORK:-/tmp/gpusnap-store-h200}
JOBS=${JOBS:-8}
BUDGET_S=${BUDGET_S:-290}
DEADLINE=$(($(date +%s) + BUDGET_S))
mkdir -p "$LOG"
LOG=$(readlink -f "$LOG")
exec > >(tee -a "$LOG/run.log") 2>&1

# Bounds a step with `timeout`: CAP seconds, or what is left of the budget if less.
bounded() {  # CAP COMMAND...
  local cap=$1 left=$((DEADLINE - $(date +%s) - 10))
  shift
  ((left < cap)) && cap=$left
  if ((cap < 5)); then
    echo "bench: out of time before: $*" >&2
    return 124
  fi
  timeout -k 5 "$cap" "$@"
}
step() { echo "bench: $(date +%T) $*"; }

step "start; work in $WORK, carried files from $CARRY"
echo "host: $(uname -r), $(nproc) cores, $(awk '/MemTotal/ {print $2 / 1048576 " GiB"}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
rm -rf "$WORK"
mkdir -p "$WORK/bin" || exit 1
cd "$WORK" || exit 1
for b in gpusnap docker-registry skopeo; do
  gzip -dc "$CARRY/$b.gz" >"bin/$b" && chmod 0755 "bin/$b" || { echo "bench: cannot unpack $b" >&2; exit 1; }
done
cp "$CARRY/gpusnap-test-workload" bin/ && chmod 0755 bin/gpusnap-test-workload
GPUSNAP=$WORK/bin/gpusnap
# shellcheck disable=SC2034  # WORKLOAD and REGISTRY are read by store_registry_lib.sh
WORKLOAD=$WORK/bin/gpusnap-test-workload
# shellcheck disable=SC2034
REGISTRY=$WORK/bin/docker-registry
# skopeo with its carried libraries and trust policy, as a program (`timeout` runs it).
cat >bin/skopeo-carried <<SH
#!/bin/sh
LD_LIBRARY_PATH=$CARRY/lib exec $WORK/bin/skopeo --policy $CARRY/policy.json "\$@"
SH
chmod 0755 bin/skopeo-carried
SKOPEO=$WORK/bin/skopeo-carried
source "$CARRY/store_registry_lib.sh"
trap store_bench_cleanup EXIT
echo "gpusnap: $("$GPUSNAP" --version 2>&1 | head -1); skopeo: $("$SKOPEO" --version 2>&1 | head -1); criu: ${GPUSNAP_CRIU:-criu on PATH}"
df -h "$WORK" | tail -1

PORT=$((20000 + RANDOM % 20000))
step "registry on 127.0.0.1:$PORT"
start_registry main "$PORT" "$WORK/registry" || exit 1
sample_load

step "capture of the test workload holding $MIB MiB"
if ! READY_WAIT_S=60 CAPTURE_TIMEOUT_S=90 capture art "$MIB" 1; then
  echo "bench: the capture failed" >&2
  exit 1
fi
for p in "${WL_PIDS[@]}"; do kill "$p" 2>/dev/null; done
BYTES=$(du -sb --apparent-size art | cut -f1)
step "artifact: $BYTES bytes; OCI layout of the same files for skopeo"
export -f oci_layout
bounded 60 bash -c 'oci_layout art layout' || { echo "bench: the OCI layout failed" >&2; exit 1; }
bounded 60 sync

REF=oci://127.0.0.1:$PORT/bench/gpusnap:a
report_row() { echo "row: ${ROWS[-1]}"; }
measure "gpusnap push (--jobs $JOBS)" "$REG_PID_main" \
  bounded 75 "$GPUSNAP" push art "$REF" --plain-http --jobs "$JOBS" --json -q >push.json
report_row
measure "skopeo copy oci: -> registry" "$REG_PID_main" \
  bounded 75 "$SKOPEO" copy -q --dest-tls-verify=false oci:layout:a "docker://127.0.0.1:$PORT/bench/skopeo:a"
report_row
# The registry disk's own read rate: its largest blob, O_DIRECT (no page cache).
BIG=$(find registry -name data -type f -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2)
if [[ -n $BIG ]]; then
  BIG_BYTES=$(stat -c %s "$BIG")
  t0=$(now)
  if bounded 30 dd if="$BIG" of=/dev/null bs=8M iflag=direct status=none; then
    DISK="registry disk, dd iflag=direct of its largest blob ($BIG_BYTES bytes): $(secs "$t0" "$(now)") s, $(rate "$BIG_BYTES" "$(secs "$t0" "$(now)")") MB/s"
  fi
fi
step "${DISK:-registry disk: not measured}"
bounded 60 sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "bench: cannot drop the page cache"
measure "gpusnap pull (--jobs $JOBS; empty cache, page cache dropped)" "$REG_PID_main" \
  bounded 75 "$GPUSNAP" pull "$REF" -o pulled --cache cache --plain-http --jobs "$JOBS" --json -q >pull.json
report_row
bounded 60 sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
measure "skopeo copy registry -> oci: (page cache dropped)" "$REG_PID_main" \
  bounded 75 "$SKOPEO" copy -q --src-tls-verify=false "docker://127.0.0.1:$PORT/bench/skopeo:a" oci:skopeo-pulled:a
report_row
if bounded 30 cmp -s art/criu/pages-1.img pulled/criu/pages-1.img; then
  step "the pulled artifact's pages image equals the captured one"
else
  step "THE PULLED ARTIFACT DIFFERS from the captured one (or was not pulled)"
fi

{
  echo "$MIB MiB test workload, $(nproc) cores, gpusnap --jobs $JOBS, registry on loopback ($WORK)"
  echo
  results_table "$BYTES"
  echo
  echo "${DISK:-registry disk: not measured}"
  echo "push: $(grep -o '"chunks[a-z_]*": *[0-9]*' push.json | tr '\n' ' ')"
  echo "pull: $(grep -o '"chunks[a-z_]*": *[0-9]*' pull.json | tr '\n' ' ')"
  echo "load average during the run (1-minute, every 5 s): $(load_summary)"
} | tee "$LOG/results.md"
step "done; removing $WORK"
store_bench_cleanup
cd / && rm -rf "$WORK"
