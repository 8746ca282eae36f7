#!/usr/bin/env bash
# Podman's own checkpoint/restore vs gpusnap's, side by side in one run on one machine, on the
# same container workload from the same image.
#
#   bench/run podman [RESULTS.md]      (root) (default /tmp/gpusnap-bench-podman.md)
#
# The image (scripts/build-image --rootfs) holds busybox and the test workload; both runtimes
# run it as `gpusnap init -- gpusnap-test-workload --mib 2048 --threads 2 --children 3` (four
# processes, 2 GiB written), with the built gpusnap and its preload library bind-mounted
# read-only in /bin, a tmpfs /tmp and no network but loopback. The source is left running.
# Each round, alternating which of the two goes first:
#   podman    `podman container checkpoint --leave-running --export TAR` (Podman's default
#             compression, zstd), then `podman container restore --import TAR --name COPY`: a
#             new container. Podman runs runc, and runc runs `criu` from PATH: a directory
#             holding only a link to CRIU >= 4.2 (GPUSNAP_CRIU) comes first on Podman's PATH.
#             `--print-stats` gives CRIU's own figures (frozen time, memory dump and write).
#   gpusnap   on containerd (a private instance, runc v2 shim, namespace k8s.io, as a node runs
#             it): `gpusnap checkpoint --container ID --leave-running`, then `gpusnap restore
#             --into-container ID2` into a placeholder container (`gpusnap init --placeholder`)
#             containerd started before the timer. Phase timings from --json.
# A restored copy counts only if it answers CHECK with OK and the source's seed. Artifacts live
# under BENCH_DIR and are read back from the page cache (no cache drop): both sides alike.
# Wall time is measured around each command. Prints a markdown table (medians, then every
# run) to stdout and RESULTS.md; the JSON and stats of each run are kept in RESULTS-logs/.
# Containers, images, containerd and artifacts are removed on exit, also on error or Ctrl-C.
#
# Environment: BENCH_MIB (2048), BENCH_CHILDREN (3), BENCH_THREADS (2), BENCH_RUNS (3),
# BENCH_DIR (/tmp), GPUSNAP (build/gpusnap), WORKLOAD (build/tests/gpusnap-test-workload),
# PRELOAD (build/libgpusnap-preload.so), GPUSNAP_CRIU (/opt/gpusnap/criu/criu).
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
RESULTS=${1:-/tmp/gpusnap-bench-podman.md}
MIB=${BENCH_MIB:-2048}
CHILDREN=${BENCH_CHILDREN:-3}
THREADS=${BENCH_THREADS:-2}
RUNS=${BENCH_RUNS:-3}
BENCH_DIR=${BENCH_DIR:-/tmp}
GPUSNAP=${GPUSNAP:-$ROOT/build/gpusnap}
WORKLOAD=${WORKLOAD:-$ROOT/build/tests/gpusnap-test-workload}
PRELOAD=${PRELOAD:-$ROOT/build/libgpusnap-preload.so}
export GPUSNAP_CRIU=${GPUSNAP_CRIU:-/opt/gpusnap/criu/criu}
LOGS=${RESULTS%.md}-logs
PORT=7000

die() {
  echo "bench: $*" >&2
  exit 1
}

[[ $(id -u) == 0 ]] || die "run as root (CRIU, containers)"
for tool in "$GPUSNAP" "$WORKLOAD" "$PRELOAD" "$GPUSNAP_CRIU"; do
  [[ -e $tool ]] || die "$tool is missing: build first (scripts/build) or install CRIU"
done
for tool in podman containerd ctr runc jq nsenter python3 du timeout; do
  command -v "$tool" >/dev/null || die "$tool is missing (scripts/install-deps)"
done

WORK=$(mktemp -d "$BENCH_DIR/gpusnap-bench-podman.XXXXXX")
TAG=b$(date +%s)
IMAGE=gpusnap.bench/workload:$TAG
CTRD_PID=
PODMAN_CONTAINERS=()
CTR_TASKS=()

ctr_() { ctr -a "$WORK/containerd/containerd.sock" -n k8s.io "$@"; }
# Kills a containerd task, waits until it has stopped, and deletes it and its container.
ctr_end() {
  ctr_ task kill -s SIGKILL "$1" >/dev/null 2>&1 || true
  for _ in $(seq 300); do
    [[ $(ctr_ task ls | awk -v id="$1" '$1 == id { print $3 }') != RUNNING ]] && break
    sleep 0.1
  done
  ctr_ task delete -f "$1" >/dev/null 2>&1 || true
  ctr_ container delete "$1" >/dev/null 2>&1 || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local c
  for c in "${PODMAN_CONTAINERS[@]}"; do podman rm -f -t 0 "$c" >/dev/null 2>&1 || true; done
  podman rmi -f "$IMAGE" >/dev/null 2>&1 || true
  for c in "${CTR_TASKS[@]}"; do ctr_end "$c"; done
  [[ -n $CTRD_PID ]] && kill "$CTRD_PID" 2>/dev/null && wait "$CTRD_PID" 2>/dev/null
  # A task containerd could not delete leaves its root filesystem mounted.
  awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/mounts | xargs -r -n1 umount -l
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT INT TERM

# Private copies: a rebuild of build/ during the run changes nothing.
mkdir -p "$WORK/bin" "$WORK/gpusnap" "$LOGS"
cp "$GPUSNAP" "$WORK/gpusnap/gpusnap"
cp "$PRELOAD" "$WORK/gpusnap/libgpusnap-preload.so"
cp "$WORKLOAD" "$WORK/gpusnap/gpusnap-test-workload"
GPUSNAP=$WORK/gpusnap/gpusnap
PRELOAD=$WORK/gpusnap/libgpusnap-preload.so
WORKLOAD=$WORK/gpusnap/gpusnap-test-workload

# CRIU >= 4.2 first on PATH, for Podman's runc (and Podman's own version check).
ln -s "$(readlink -f "$GPUSNAP_CRIU")" "$WORK/bin/criu"
export PATH=$WORK/bin:$PATH
CRIU_VERSION=$(criu --version | awk '/^Version:/ { print $2 }')
[[ $(printf '%s\n4.2\n' "$CRIU_VERSION" | sort -V | head -1) == 4.2 ]] ||
  die "CRIU on PATH is $CRIU_VERSION; Podman's checkpoint needs >= 4.2 on this kernel"
OCI_RUNTIME=$(podman info --format '{{.Host.OCIRuntime.Version}}')
OCI_RUNTIME=${OCI_RUNTIME%%$'\n'*}

# The image: busybox, the workload and its libraries, mount points for gpusnap and its library.
rootfs=$WORK/rootfs
mkdir -p "$rootfs"/{bin,proc,dev,sys,tmp,control}
cp /bin/busybox "$rootfs/bin/busybox"
ln -s busybox "$rootfs/bin/sh"
cp "$WORKLOAD" "$rootfs/bin/gpusnap-test-workload"
for lib in $(ldd "$WORKLOAD" | grep -o '/[^ ]*'); do
  mkdir -p "$rootfs$(dirname "$lib")"
  cp "$(readlink -f "$lib")" "$rootfs$lib"
done
: >"$rootfs/bin/gpusnap"
: >"$rootfs/bin/libgpusnap-preload.so"
python3 "$ROOT/scripts/build-image" --rootfs "$rootfs" --output "$WORK/image" \
  --name gpusnap.bench/workload --tag "$TAG" >/dev/null
podman load -q -i "$WORK/image/gpusnap-image.tar" >/dev/null

# containerd of the benchmark's own, as the tests start it.
mkdir -p "$WORK/containerd"
cat >"$WORK/containerd/config.toml" <<EOF
version = 2
root = "$WORK/containerd/root"
state = "$WORK/containerd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$WORK/containerd/containerd.sock"
[ttrpc]
  address = "$WORK/containerd/containerd.sock.ttrpc"
[debug]
  address = ""
EOF
containerd --config "$WORK/containerd/config.toml" >"$WORK/containerd/log" 2>&1 &
CTRD_PID=$!
for _ in $(seq 100); do ctr_ version >/dev/null 2>&1 && break; sleep 0.1; done
ctr_ version >/dev/null || die "containerd did not start: $(tail -5 "$WORK/containerd/log")"
ctr_ images import "$WORK/image/gpusnap-image.tar" >/dev/null

CMD=(/bin/gpusnap init -- /bin/gpusnap-test-workload --port "$PORT" --mib "$MIB"
  --threads "$THREADS" --children "$CHILDREN")
PLACEHOLDER=(/bin/gpusnap init --placeholder)

# One request line to the workload in the network namespace of process $1. CHECK reads all of
# the workload's memory: on a busy machine that takes a while.
ask() {
  nsenter -t "$1" -n timeout 180 bash -c \
    'exec 3<>/dev/tcp/127.0.0.1/'"$PORT"' && echo "$0" >&3 && read -r r <&3 && echo "$r"' \
    "$2" 2>/dev/null || true
}
wait_ready() {
  for _ in $(seq 600); do
    [[ $(ask "$1" PING) == PONG ]] && return 0
    sleep 0.1
  done
  die "the workload in pid $1 did not answer"
}
# "seed=S" when the workload's memory checks out, else its reply (or nothing).
seed_of() {
  local reply
  reply=$(ask "$1" CHECK)
  [[ $reply == OK* ]] && grep -o 'seed=[^ ]*' <<<"$reply" || echo "$reply"
}
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# These run in $(...), a subshell: the caller registers what they start for the cleanup.
podman_source() {
  # Podman's default rlimits can be above the host's hard limits (nofile 20000 here), which
  # runc cannot raise, and the container fails to start: runc's own defaults instead.
  podman run -d -q --name "bench-src-$TAG" --network none --runtime runc \
    --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 \
    --tmpfs /tmp:rw,mode=1777 --tmpfs /control:rw,mode=700 -e GPUSNAP_CONTROL_DIR=/control \
    -v "$(readlink -f "$GPUSNAP"):/bin/gpusnap:ro" \
    -v "$(readlink -f "$PRELOAD"):/bin/libgpusnap-preload.so:ro" "$IMAGE" "${CMD[@]}" >/dev/null
  podman inspect -f '{{.State.Pid}}' "bench-src-$TAG"
}
ctr_run() {
  local id=$1
  shift
  ctr_ run -d --log-uri "file://$WORK/$id.log" \
    --mount "type=bind,src=$(readlink -f "$GPUSNAP"),dst=/bin/gpusnap,options=rbind:ro" \
    --mount "type=bind,src=$(readlink -f "$PRELOAD"),dst=/bin/libgpusnap-preload.so,options=rbind:ro" \
    --mount type=tmpfs,src=tmpfs,dst=/tmp,options=nosuid:nodev:mode=1777 \
    --mount type=tmpfs,src=tmpfs,dst=/control,options=nosuid:nodev:mode=700 \
    --env GPUSNAP_CONTROL_DIR=/control "$IMAGE" "$id" "$@" >/dev/null
  ctr_ task ls | awk -v id="$id" '$1 == id { print $2 }'
}

echo "bench: sources: ${MIB} MiB, $((CHILDREN + 1)) processes, $THREADS threads" >&2
PODMAN_CONTAINERS+=("bench-src-$TAG")
PODMAN_SRC=$(podman_source)
CTR_TASKS+=("bench-src-$TAG")
CTR_SRC=$(ctr_run "bench-src-$TAG" "${CMD[@]}")
wait_ready "$PODMAN_SRC"
wait_ready "$CTR_SRC"
SEED_PODMAN=$(seed_of "$PODMAN_SRC")
SEED_CTR=$(seed_of "$CTR_SRC")

ROWS=()
# A copy counts only if its whole memory checks out and is the source's.
check_copy() {
  local seed
  seed=$(seed_of "$3")
  [[ $seed == "$4" ]] || die "$1's copy $2 (pid $3) answered '$seed', not the source's $4"
}
# One row: TOOL ROUND, capture from $3 to $4, restore from $5 to $6, the artifact at $7.
record() {
  ROWS+=("$1|$2|$(secs "$3" "$4")|$(secs "$5" "$6")|$(du -sb "$7" | cut -f1)")
}
run_podman() {
  local n=$1 t0 t1 t2 pid
  local tar=$WORK/podman-$n.tar
  t0=$(now)
  podman container checkpoint --leave-running --print-stats --export "$tar" "bench-src-$TAG" \
    >"$LOGS/podman-checkpoint-$n.json"
  t1=$(now)
  PODMAN_CONTAINERS+=("bench-copy-$TAG-$n")
  podman container restore --print-stats --import "$tar" --name "bench-copy-$TAG-$n" \
    >"$LOGS/podman-restore-$n.json"
  t2=$(now)
  pid=$(podman inspect -f '{{.State.Pid}}' "bench-copy-$TAG-$n")
  # Podman 4.3 restores a `--network none` container into a new network namespace whose
  # loopback is down: the workload listens, unreachable. Up it, outside the timing.
  nsenter -t "$pid" -n ip link set lo up
  check_copy podman "$n" "$pid" "$SEED_PODMAN"
  record podman "$n" "$t0" "$t1" "$t1" "$t2" "$tar"
  podman rm -f -t 0 "bench-copy-$TAG-$n" >/dev/null
  rm -f "$tar"
}
run_gpusnap() {
  local n=$1 t0 t1 t2 ph
  local out=$WORK/gpusnap-$n
  t0=$(now)
  "$GPUSNAP" checkpoint --container "bench-src-$TAG" -o "$out" --leave-running --json --quiet \
    >"$LOGS/gpusnap-checkpoint-$n.json"
  t1=$(now)
  CTR_TASKS+=("bench-ph-$TAG-$n")
  ph=$(ctr_run "bench-ph-$TAG-$n" "${PLACEHOLDER[@]}")
  local t1r
  t1r=$(now)
  "$GPUSNAP" restore "$out" --into-container "bench-ph-$TAG-$n" --run-dir "$WORK/run" --json \
    --quiet >"$LOGS/gpusnap-restore-$n.json"
  t2=$(now)
  check_copy gpusnap "$n" "$ph" "$SEED_CTR"
  record gpusnap "$n" "$t0" "$t1" "$t1r" "$t2" "$out"
  ctr_end "bench-ph-$TAG-$n"
  rm -rf "$out"
}

for n in $(seq "$RUNS"); do
  echo "bench: round $n of $RUNS" >&2
  if ((n % 2)); then
    run_podman "$n"
    run_gpusnap "$n"
  else
    run_gpusnap "$n"
    run_podman "$n"
  fi
done
# The sources served throughout.
[[ $(seed_of "$PODMAN_SRC") == "$SEED_PODMAN" && $(seed_of "$CTR_SRC") == "$SEED_CTR" ]] ||
  die "a source stopped serving"

median() { sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
{
  echo "Podman $(podman --version | awk '{ print $3 }') ($OCI_RUNTIME, CRIU $CRIU_VERSION) vs gpusnap on containerd $(containerd --version | awk '{ print $3 }'):"
  echo "${MIB} MiB, $((CHILDREN + 1)) processes, $RUNS rounds, $(nproc) CPUs, $(date -u +%Y-%m-%d)"
  echo
  echo "| tool | capture s (median) | restore s (median) | artifact MiB (median) |"
  echo "| --- | --- | --- | --- |"
  for tool in podman gpusnap; do
    c=$(printf '%s\n' "${ROWS[@]}" | awk -F'|' -v t=$tool '$1 == t { print $3 }' | median)
    r=$(printf '%s\n' "${ROWS[@]}" | awk -F'|' -v t=$tool '$1 == t { print $4 }' | median)
    s=$(printf '%s\n' "${ROWS[@]}" | awk -F'|' -v t=$tool '$1 == t { print $5 }' | median)
    echo "| $tool | $c | $r | $(awk -v s="$s" 'BEGIN { printf "%.0f", s / 1048576 }') |"
  done
  echo
  echo "| tool | round | capture s | restore s | artifact bytes |"
  echo "| --- | --- | --- | --- | --- |"
  for row in "${ROWS[@]}"; do echo "| ${row//|/ | } |"; done
} | tee "$RESULTS"
