# shellcheck shell=bash
# The parts of store_registry_bench.sh (`bench/run store-registry`) that stand alone: a
# docker-registry on loopback, a capture of the test workload, the same bytes as an OCI image
# layout for skopeo, and transfers timed with the CPU seconds of both sides. Sourced, not run. Needs only bash, coreutils, awk and setsid: no bc,
# curl or jq (absent on a bare machine).
#
# The caller sets GPUSNAP, WORKLOAD and REGISTRY (paths of the binaries) and runs in its work
# directory.

REG_PIDS=()
WL_PIDS=()
ROWS=()

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
rate() { awk -v n="$1" -v s="$2" 'BEGIN { printf "%.1f", n / s / 1e6 }'; }  # bytes s -> MB/s

store_bench_cleanup() {
  for p in "${REG_PIDS[@]}" "${WL_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
}

# A docker-registry on 127.0.0.1:PORT (plain HTTP) with its storage in DIR; sets
# REG_PID_<NAME>. Waits (at most 10 s) until it accepts connections.
start_registry() {  # NAME PORT DIR
  cat >"registry-$1.yml" <<YML
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $3
http:
  addr: 127.0.0.1:$2
  secret: bench
YML
  "$REGISTRY" serve "registry-$1.yml" >"registry-$1.log" 2>&1 &
  REG_PIDS+=($!)
  printf -v "REG_PID_$1" %s $!
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "bench: the registry did not start (registry-$1.log)" >&2
  return 1
}

# The 1-minute load average every 5 s into loadavg.log, until the cleanup.
sample_load() {
  while sleep 5; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; done >loadavg.log &
  REG_PIDS+=($!)
}

load_summary() {
  awk '{ if (min == "" || $2 < min) min = $2; if ($2 > max) max = $2; n++ }
       END { printf "min %s, max %s, %d samples", min, max, n }' loadavg.log
}

# A capture of the test workload holding MIB of memory with a fixed seed, into NAME. The
# workload's start is bounded by READY_WAIT_S (default 60) seconds, the checkpoint by
# CAPTURE_TIMEOUT_S when set.
capture() {  # NAME MIB SEED
  local bound=()
  [[ -n ${CAPTURE_TIMEOUT_S:-} ]] && bound=(timeout -k 5 "$CAPTURE_TIMEOUT_S")
  mkdir -p "wl-$1"
  setsid "$WORKLOAD" --mib "$2" --seed "$3" --children 0 --ready-file "wl-$1/ready" \
    </dev/null >"wl-$1/log" 2>&1 &
  local pid=$!  # setsid execs in place: the shell's background child is not a group leader
  WL_PIDS+=("$pid")
  for _ in $(seq $((${READY_WAIT_S:-60} * 10))); do [[ -f wl-$1/ready ]] && break; sleep 0.1; done
  [[ -f wl-$1/ready ]] || { echo "bench: the workload did not get ready (wl-$1/log)" >&2; return 1; }
  "${bound[@]}" "$GPUSNAP" checkpoint --pid "$pid" -o "$1" -q
}

# The files of artifact ART as an OCI image layout in DIR (image "a") for skopeo: one
# uncompressed layer per file, hard-linked where it can be.
oci_layout() {  # ART DIR
  local art=$1 dir=$2 layers="" f d s cfg cd_ man md
  mkdir -p "$dir/blobs/sha256"
  for f in $(cd "$art" && find . -type f | sort); do
    d=$(sha256sum "$art/$f" | cut -d' ' -f1)
    ln -f "$art/$f" "$dir/blobs/sha256/$d" 2>/dev/null || cp "$art/$f" "$dir/blobs/sha256/$d"
    s=$(stat -c %s "$art/$f")
    layers+="${layers:+,}{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:$d\",\"size\":$s}"
  done
  cfg='{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
  cd_=$(printf %s "$cfg" | sha256sum | cut -d' ' -f1)
  printf %s "$cfg" >"$dir/blobs/sha256/$cd_"
  man="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$cd_\",\"size\":${#cfg}},\"layers\":[$layers]}"
  md=$(printf %s "$man" | sha256sum | cut -d' ' -f1)
  printf %s "$man" >"$dir/blobs/sha256/$md"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%d,"annotations":{"org.opencontainers.image.ref.name":"a"}}]}' "$md" ${#man} >"$dir/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' >"$dir/oci-layout"
}

# CPU seconds of process PID, and of this shell's waited-for children.
cpu_of() { awk -v t="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / t}' "/proc/$1/stat"; }
children_cpu() { awk -v t="$(getconf CLK_TCK)" '{printf "%.2f", ($16 + $17) / t}' "/proc/$$/stat"; }

# Runs a transfer; appends "LABEL|seconds|client CPU s|registry CPU s|status" to ROWS. A
# failed command is recorded (its exit status) and returns 1.
measure() {  # LABEL REGISTRY_PID COMMAND...
  local label=$1 reg=$2 r0 r1 t0 t1 c0 c1 rc=0
  shift 2
  echo "bench: $label (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  r0=$(cpu_of "$reg")
  c0=$(children_cpu)
  t0=$(now)
  "$@" || rc=$?
  t1=$(now)
  c1=$(children_cpu)
  r1=$(cpu_of "$reg")
  ROWS+=("$label|$(secs "$t0" "$t1")|$(secs "$c0" "$c1")|$(secs "$r0" "$r1")|$rc")
  return $((rc != 0))
}

# The rows as a Markdown table, MB/s of BYTES.
results_table() {  # BYTES
  local label s client reg rc
  echo "| | seconds | MB/s of the artifact's $1 bytes | client CPU s | registry CPU s |"
  echo "| --- | --- | --- | --- | --- |"
  for row in "${ROWS[@]}"; do
    IFS='|' read -r label s client reg rc <<<"$row"
    if [[ $rc == 0 ]]; then
      echo "| $label | $s | $(rate "$1" "$s") | $client | $reg |"
    else
      echo "| $label | $s (FAILED, exit $rc) | - | $client | $reg |"
    fi
  done
}
