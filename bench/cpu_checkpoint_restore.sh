#!/usr/bin/env bash
# Plain CRIU vs gpusnap, side by side, on one CPU workload holding 4 GiB, in one run on one
# machine.
#
#   bench/run cpu-checkpoint [RESULTS.md]      (root) (default /tmp/gpusnap-bench-cpu.md)
#
# The source is the test workload (--mib 4096 --threads 4 --children 0), left running throughout.
# Each round measures, alternating which of the two goes first:
#   plain CRIU   criu dump --leave-running (gpusnap's dump options), then criu restore of that
#                image in a fresh PID+mount+net namespace (unshare), the source still running;
#                also, untimed in the dump, the `sync` that would make the image durable
#   gpusnap      checkpoint --leave-running; verify alone; restore (1 copy, verifying); restore
#                --no-verify. Phase timings from --json, wall time around each command.
# Every restored copy must answer CHECK with OK and the source's seed and pid to count as a
# success. Images live under /tmp, read back from the page cache (no cache drop): both sides
# alike. gpusnap and the workload run from private copies made at the start, so a rebuild of
# build/ during the run changes nothing. docs/benchmarks.md has the results and how to read them.
# Prints a markdown table (medians, then every run) to stdout and RESULTS.md; CRIU's and gpusnap's
# logs and JSON of each run are kept in RESULTS-logs/. Everything else (processes, namespaces,
# images) is removed on exit, also on error or Ctrl-C.
#
# Environment: BENCH_MIB (4096), BENCH_THREADS (4), BENCH_RUNS (3), BENCH_DIR (/tmp),
# GPUSNAP (build/gpusnap), WORKLOAD (build/tests/gpusnap-test-workload),
# GPUSNAP_CRIU (/opt/gpusnap/criu/criu; gpusnap uses the same one).
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
RESULTS=${1:-/tmp/gpusnap-bench-cpu.md}
MIB=${BENCH_MIB:-4096}
THREADS=${BENCH_THREADS:-4}
RUNS=${BENCH_RUNS:-3}
BENCH_DIR=${BENCH_DIR:-/tmp}
GPUSNAP=${GPUSNAP:-$ROOT/build/gpusnap}
WORKLOAD=${WORKLOAD:-$ROOT/build/tests/gpusnap-test-workload}
export GPUSNAP_CRIU=${GPUSNAP_CRIU:-/opt/gpusnap/criu/criu}
CRIU=$GPUSNAP_CRIU
LOGS=${RESULTS%.md}-logs

die() {
  echo "bench: $*" >&2
  exit 1
}

[[ $(id -u) == 0 ]] || die "run as root (CRIU and namespaces need it)"
for tool in "$GPUSNAP" "$WORKLOAD" "$CRIU"; do
  [[ -x $tool ]] || die "$tool is missing: build first (scripts/build) or install CRIU"
done
for tool in jq unshare nsenter ip timeout du sync; do
  command -v "$tool" >/dev/null || die "$tool is missing"
done

WORK=$(mktemp -d "$BENCH_DIR/gpusnap-bench-cpu.XXXXXX")
SOURCE_PID=
KILL_PIDS=()  # namespace inits and launchers to SIGKILL at exit (killing an init ends its copy)

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  for pid in "${KILL_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  if [[ -n $SOURCE_PID ]]; then kill -KILL "$SOURCE_PID" 2>/dev/null || true; fi
  for pid in "${KILL_PIDS[@]}" $SOURCE_PID; do wait_gone "$pid" || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Private copies: a rebuild of build/ during the run must not swap the binaries under us (and
# CRIU restores the workload from its executable's path, which must stay as it was dumped).
VERSION=$("$GPUSNAP" --version)
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -z $(git -C "$ROOT" status --porcelain 2>/dev/null) ]] || COMMIT+=" + uncommitted changes"
cp "$GPUSNAP" "$WORK/gpusnap"
cp "$WORKLOAD" "$WORK/gpusnap-test-workload"
GPUSNAP=$WORK/gpusnap
WORKLOAD=$WORK/gpusnap-test-workload

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }

# Waits (up to 30 s) until PID is gone or a zombie.
wait_gone() {
  local pid=$1 i state
  for ((i = 0; i < 3000; i++)); do
    [[ -e /proc/$pid ]] || return 0
    state=$(awk '{ print $3 }' "/proc/$pid/stat" 2>/dev/null) || return 0
    [[ $state == Z ]] && return 0
    sleep 0.01
  done
  echo "bench: warning: pid $pid still there after 30 s" >&2
  return 1
}

forget() {  # drops PID from KILL_PIDS
  local keep=() p
  for p in "${KILL_PIDS[@]}"; do [[ $p == "$1" ]] || keep+=("$p"); done
  KILL_PIDS=("${keep[@]}")
}

# ask PORT COMMAND [NETNS_PID]: one request to the workload, prints the reply line.
ask() {
  local enter=()
  [[ -n ${3:-} ]] && enter=(nsenter -t "$3" -n)
  timeout 120 "${enter[@]}" bash -c '
    exec 3<>"/dev/tcp/127.0.0.1/$0" || exit 1
    printf "%s\n" "$1" >&3
    IFS= read -r line <&3 || exit 1
    printf "%s\n" "${line%$'"'"'\r'"'"'}"' "$1" "$2" 2>/dev/null || true
}

# check PORT [NETNS_PID]: "ok:N" when CHECK answers OK with the source's seed and pid at the N-th
# attempt, else "fail". An attempt that gets no answer at all is repeated (up to 10 times, 0.5 s
# apart): gpusnap's port relay can drop the very first connection to a fresh copy (see
# docs/benchmarks.md); a wrong answer is final.
check_copy() {
  local reply attempt
  for ((attempt = 1; attempt <= 10; attempt++)); do
    reply=$(ask "$1" CHECK "${2:-}")
    [[ -n $reply ]] && break
    sleep 0.5
  done
  if [[ $reply == "OK seed=$SOURCE_SEED pid=$SOURCE_PID" ]]; then
    echo "ok:$attempt"
  else
    echo "bench: copy answered CHECK with '${reply:-nothing}'" >&2
    echo fail
  fi
}

# Results: NAME -> space-separated values, one per run ("-" for a failed run).
declare -A VALUES
record() {  # record NAME VALUE: numbers kept with 3 decimals (jq may print 1.2e-05)
  local v=$2
  if [[ $v =~ ^[0-9.]+([eE][-+]?[0-9]+)?$ ]]; then v=$(awk -v x="$v" 'BEGIN { printf "%.3f", x }'); fi
  VALUES[$1]="${VALUES[$1]:-} $v"
}
median() {  # median of the numeric values of NAME; "n/a" if none
  local v
  v=$(tr ' ' '\n' <<<"${VALUES[$1]:-}" | grep -E '^[0-9.]+$' | sort -g |
    awk '{ a[NR] = $1 } END { if (NR == 0) print "n/a";
      else if (NR % 2) printf "%.3f", a[(NR + 1) / 2];
      else printf "%.3f", (a[NR / 2] + a[NR / 2 + 1]) / 2 }')
  echo "$v"
}
runs() { sed 's/^ //' <<<"${VALUES[$1]:-}"; }
successes() { tr ' ' '\n' <<<"${VALUES[$1]:-}" | grep -c '^ok:' || true; }
# How many successes needed more than one CHECK attempt.
retried() { tr ' ' '\n' <<<"${VALUES[$1]:-}" | grep -c '^ok:[2-9]\|^ok:10' || true; }
phase() { jq -r --arg n "$2" '[.phases[] | select(.name == $n) | .seconds] | add // 0' "$1"; }
# CRIU's own duration: the timestamp of the last line of its -v4 log ("(SS.ssssss) ...").
log_seconds() { sed -n 's/^(\([0-9]*\.[0-9]*\)).*/\1/p' "$1" 2>/dev/null | tail -n1 | grep . || echo -; }

mkdir -p "$LOGS"
rm -f "$LOGS"/*.log "$LOGS"/*.json

# --- the source ---------------------------------------------------------------------------------
echo "bench: starting the workload (${MIB} MiB, ${THREADS} threads)..." >&2
setsid "$WORKLOAD" --mib "$MIB" --threads "$THREADS" --children 0 --ready-file "$WORK/ready" \
  </dev/null >"$WORK/workload.log" 2>&1 &
LAUNCHED=$!
KILL_PIDS+=("$LAUNCHED")
for ((i = 0; i < 6000; i++)); do
  [[ -s $WORK/ready ]] && break
  kill -0 "$LAUNCHED" 2>/dev/null || die "the workload exited: $(cat "$WORK/workload.log")"
  sleep 0.05
done
[[ -s $WORK/ready ]] || die "the workload did not become ready in 300 s"
PORT=$(<"$WORK/ready")
SOURCE_PID=$(sed -n 's/^ready port=[0-9]* pid=\([0-9]*\).*/\1/p' "$WORK/workload.log")
[[ -n $SOURCE_PID ]] || die "no pid in the workload's output: $(cat "$WORK/workload.log")"
SOURCE_SEED=$(ask "$PORT" INFO | sed -n 's/.* seed=\([0-9a-f]*\).*/\1/p')
[[ -n $SOURCE_SEED ]] || die "the workload does not answer INFO on port $PORT"
[[ $(check_copy "$PORT") == ok:* ]] || die "the source itself fails CHECK"
echo "bench: source pid $SOURCE_PID, port $PORT, seed $SOURCE_SEED" >&2

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
# How fast this machine hands out fresh memory: dd reads 1 GiB of zeros into a buffer it has just
# allocated, so every page is touched for the first time (a restore does the same with 4 GiB).
FIRST_TOUCH=$(dd if=/dev/zero of=/dev/null bs=1G count=1 2>&1 | sed -n 's/.*copied, \(.*\)$/\1/p')
FSTYPE=$(findmnt -no FSTYPE -T "$WORK" 2>/dev/null || stat -f -c %T "$WORK")
FSDEV=$(findmnt -no SOURCE -T "$WORK" 2>/dev/null || echo "?")

# --- plain CRIU ---------------------------------------------------------------------------------
plain_round() {
  local r=$1 dir=$WORK/plain t0 init="" rc tin0 tin1
  rm -rf "$dir"
  mkdir -p "$dir"
  sync
  echo "bench: run $r: plain criu dump..." >&2
  t0=$(now)
  "$CRIU" dump -t "$SOURCE_PID" -D "$dir" --leave-running --tcp-established --ext-unix-sk \
    --file-locks --skip-in-flight --network-lock skip -v4 -o dump.log ||
    die "plain criu dump failed (log: $LOGS/plain-dump-$r.log)"
  record plain.dump "$(since "$t0")"
  cp "$dir/dump.log" "$LOGS/plain-dump-$r.log"
  record plain.dump.log "$(log_seconds "$dir/dump.log")"
  t0=$(now)
  sync
  record plain.sync "$(since "$t0")"
  record plain.bytes "$(du -sb "$dir" | cut -f1)"

  echo "bench: run $r: plain criu restore in a fresh PID+mount+net namespace..." >&2
  # The namespace's init (sh) reports criu's exit status and times through a FIFO, which this
  # shell waits on without polling (a polling loop's forks halve this machine's page-fault rate,
  # which is what a restore spends its time on), then stays alive: the copy dies with it.
  mkfifo "$dir/done"
  exec 7<>"$dir/done"
  t0=$(now)
  unshare -p -m -n -f --mount-proc --kill-child sh -c '
    ip link set lo up
    t0=$(date +%s.%N)
    "$0" restore -D "$1" -d --tcp-close --ext-unix-sk --file-locks -v4 -o restore.log \
      --pidfile "$1/restored.pid"
    rc=$?
    echo "$rc $t0 $(date +%s.%N)" >"$1/done"
    exec sleep 100000' "$CRIU" "$dir" </dev/null >"$dir/unshare.out" 2>&1 &
  local launcher=$!
  KILL_PIDS+=("$launcher")
  rc=fail
  read -r -t 600 -u 7 rc tin0 tin1 || true
  local wall
  wall=$(since "$t0")
  exec 7<&-
  init=$(pgrep -P "$launcher" | head -n1 || true)
  [[ -n $init ]] && KILL_PIDS+=("$init")
  cp "$dir/restore.log" "$LOGS/plain-restore-$r.log" 2>/dev/null || true
  record plain.restore.log "$(log_seconds "$dir/restore.log")"
  if [[ $rc == 0 ]]; then
    record plain.restore.criu "$(awk -v a="$tin0" -v b="$tin1" 'BEGIN { printf "%.3f", b - a }')"
    record plain.restore.wall "$wall"
    record plain.restore.ok "$(check_copy "$PORT" "$init")"
  else
    echo "bench: plain criu restore failed: $(cat "$dir/unshare.out" 2>/dev/null)" >&2
    record plain.restore.criu -
    record plain.restore.log -
    record plain.restore.wall -
    record plain.restore.ok fail
  fi
  # End the copy: SIGKILL to the namespace's init kills everything in the namespace.
  if [[ -n $init ]]; then
    kill -KILL "$init" 2>/dev/null || true
    wait_gone "$init" || true
    forget "$init"
  fi
  wait "$launcher" 2>/dev/null || true
  forget "$launcher"
  rm -rf "$dir"
}

# --- gpusnap ------------------------------------------------------------------------------------
gpusnap_restore() {  # gpusnap_restore RUN TAG [--no-verify]
  local r=$1 tag=$2 art=$WORK/art t0 wall json=$LOGS/gpusnap-restore$2-$1.json init port dir
  shift 2
  sync
  echo "bench: run $r: gpusnap restore $*..." >&2
  t0=$(now)
  if ! "$GPUSNAP" restore "$art" --json --publish "$PORT" --run-dir "$WORK/run" "$@" \
    >"$json" 2>"$WORK/restore.err"; then
    echo "bench: gpusnap restore failed: $(cat "$WORK/restore.err")" >&2
    record "gpusnap.restore$tag.ok" fail
    for p in seconds wall open verify criu-restore locate release log; do
      record "gpusnap.restore$tag.$p" -
    done
    return 0
  fi
  wall=$(since "$t0")
  init=$(jq -r '.copies[0].init_pid' "$json")
  KILL_PIDS+=("$init")
  port=$(jq -r '.copies[0].ports[0].host_port' "$json")
  dir=$(jq -r '.copies[0].dir' "$json")
  record "gpusnap.restore$tag.wall" "$wall"
  record "gpusnap.restore$tag.seconds" "$(jq -r '.seconds' "$json")"
  for p in open verify criu-restore locate release; do
    record "gpusnap.restore$tag.$p" "$(phase "$json" "$p")"
  done
  record "gpusnap.restore$tag.ok" "$(check_copy "$port")"
  cp "$dir/restore.log" "$LOGS/gpusnap-restore$tag-$r.log" 2>/dev/null || true
  record "gpusnap.restore$tag.log" "$(log_seconds "$dir/restore.log")"
  kill -KILL "$init" 2>/dev/null || true
  wait_gone "$init" || true
  forget "$init"
}

gpusnap_round() {
  local r=$1 art=$WORK/art t0 json=$LOGS/gpusnap-checkpoint-$1.json
  rm -rf "$art" "$WORK/run"
  sync
  echo "bench: run $r: gpusnap checkpoint..." >&2
  t0=$(now)
  "$GPUSNAP" checkpoint --pid "$SOURCE_PID" -o "$art" --leave-running --json >"$json" ||
    die "gpusnap checkpoint failed: $(cat "$json")"
  record gpusnap.ckpt.wall "$(since "$t0")"
  record gpusnap.ckpt.seconds "$(jq -r '.seconds' "$json")"
  for p in resolve preflight dump checksum commit; do
    record "gpusnap.ckpt.$p" "$(phase "$json" "$p")"
  done
  record gpusnap.bytes "$(du -sb "$art" | cut -f1)"
  cp "$art/logs/criu-dump.log" "$LOGS/gpusnap-dump-$r.log" 2>/dev/null || true
  record gpusnap.ckpt.log "$(log_seconds "$art/logs/criu-dump.log")"

  echo "bench: run $r: gpusnap verify..." >&2
  t0=$(now)
  "$GPUSNAP" verify "$art" --json >"$LOGS/gpusnap-verify-$r.json" || die "gpusnap verify failed"
  record gpusnap.verify.wall "$(since "$t0")"
  record gpusnap.verify.seconds "$(jq -r '.seconds' "$LOGS/gpusnap-verify-$r.json")"

  gpusnap_restore "$r" ""
  gpusnap_restore "$r" .noverify --no-verify
  rm -rf "$art" "$WORK/run"
}

for ((r = 1; r <= RUNS; r++)); do
  if ((r % 2)); then
    plain_round "$r"
    gpusnap_round "$r"
  else
    gpusnap_round "$r"
    plain_round "$r"
  fi
done
[[ $(check_copy "$PORT") == ok:* ]] || echo "bench: warning: the source fails CHECK at the end" >&2
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# --- report -------------------------------------------------------------------------------------
m() { median "$1"; }
gib() { awk -v b="$(median "$1")" 'BEGIN { if (b == "n/a") print "n/a"; else printf "%.3f GiB (%.0f bytes)", b / 2^30, b }'; }
{
  echo "### CPU checkpoint/restore: plain CRIU vs gpusnap"
  echo
  echo "Workload: gpusnap-test-workload --mib $MIB --threads $THREADS --children 0 (source left"
  echo "running throughout). $(date -u '+%Y-%m-%d %H:%M UTC'); kernel $(uname -r); $(nproc) CPUs;"
  echo "$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 2^20 }' /proc/meminfo) RAM; CRIU $("$CRIU" --version | sed -n 's/^Version: //p');"
  echo "$VERSION (commit $COMMIT). Images under $BENCH_DIR ($FSTYPE on $FSDEV), read back from the page"
  echo "cache. Load average (1/5/15 min) at start $LOAD_START, at end $LOAD_END. First touch of"
  echo "fresh memory (dd if=/dev/zero of=/dev/null bs=1G count=1): $FIRST_TOUCH."
  echo "Medians of $RUNS runs, in seconds; plain and gpusnap alternate which goes first."
  echo
  echo "| Checkpoint | plain CRIU | gpusnap |"
  echo "|---|---:|---:|"
  echo "| resolve + preflight | - | $(m gpusnap.ckpt.resolve) + $(m gpusnap.ckpt.preflight) |"
  echo "| criu dump | $(m plain.dump) | $(m gpusnap.ckpt.dump) |"
  echo "| (criu dump by its own log) | $(m plain.dump.log) | $(m gpusnap.ckpt.log) |"
  echo "| checksum (XXH3-128 of every file) | - | $(m gpusnap.ckpt.checksum) |"
  echo "| commit (manifest, fsync, rename) | - | $(m gpusnap.ckpt.commit) |"
  echo "| **total** (gpusnap: sum of phases) | **$(m plain.dump)** | **$(m gpusnap.ckpt.seconds)** |"
  echo "| wall clock of the command | $(m plain.dump) | $(m gpusnap.ckpt.wall) |"
  echo "| \`sync\` after the plain dump (not in its total) | $(m plain.sync) | - |"
  echo "| image size (du -sb) | $(gib plain.bytes) | $(gib gpusnap.bytes) |"
  echo
  echo "| Restore (1 copy, fresh namespaces) | plain CRIU | gpusnap | gpusnap --no-verify |"
  echo "|---|---:|---:|---:|"
  echo "| open (manifest, host checks) | - | $(m gpusnap.restore.open) | $(m gpusnap.restore.noverify.open) |"
  echo "| verify (re-read and checksum every byte) | - | $(m gpusnap.restore.verify) | - |"
  echo "| criu restore (plain: criu alone; gpusnap: init + namespaces + criu) | $(m plain.restore.criu) | $(m gpusnap.restore.criu-restore) | $(m gpusnap.restore.noverify.criu-restore) |"
  echo "| (criu restore by its own log) | $(m plain.restore.log) | $(m gpusnap.restore.log) | $(m gpusnap.restore.noverify.log) |"
  echo "| locate + release | - | $(m gpusnap.restore.locate) + $(m gpusnap.restore.release) | $(m gpusnap.restore.noverify.locate) + $(m gpusnap.restore.noverify.release) |"
  echo "| **total** (gpusnap: sum of phases) | **$(m plain.restore.criu)** | **$(m gpusnap.restore.seconds)** | **$(m gpusnap.restore.noverify.seconds)** |"
  echo "| wall clock (plain: unshare + ip + criu) | $(m plain.restore.wall) | $(m gpusnap.restore.wall) | $(m gpusnap.restore.noverify.wall) |"
  echo "| copies answering CHECK OK | $(successes plain.restore.ok)/$RUNS | $(successes gpusnap.restore.ok)/$RUNS | $(successes gpusnap.restore.noverify.ok)/$RUNS |"
  echo "| ... of which only after the first CHECK got no answer | $(retried plain.restore.ok) | $(retried gpusnap.restore.ok) | $(retried gpusnap.restore.noverify.ok) |"
  echo
  echo "| gpusnap verify alone | seconds |"
  echo "|---|---:|"
  echo "| verify phase | $(m gpusnap.verify.seconds) |"
  echo "| wall clock of the command | $(m gpusnap.verify.wall) |"
  echo
  echo "Every run (seconds, in run order):"
  echo
  echo "| Measurement | runs |"
  echo "|---|---|"
  for k in plain.dump plain.dump.log plain.sync gpusnap.ckpt.dump gpusnap.ckpt.log \
    gpusnap.ckpt.checksum gpusnap.ckpt.commit gpusnap.ckpt.seconds gpusnap.ckpt.wall \
    gpusnap.verify.seconds plain.restore.criu plain.restore.log plain.restore.wall \
    gpusnap.restore.verify gpusnap.restore.criu-restore gpusnap.restore.log \
    gpusnap.restore.seconds gpusnap.restore.wall gpusnap.restore.noverify.criu-restore \
    gpusnap.restore.noverify.log gpusnap.restore.noverify.seconds \
    gpusnap.restore.noverify.wall plain.restore.ok gpusnap.restore.ok \
    gpusnap.restore.noverify.ok; do
    echo "| $k | $(runs "$k") |"
  done
  echo
  echo "CRIU and gpusnap logs and JSON of every run: $LOGS/"
} | tee "$RESULTS"
