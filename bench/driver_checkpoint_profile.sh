#!/usr/bin/env bash
# An experiment, not a product path: where does the driver's checkpoint call spend its time, and
# what do huge pages change? For each MODE, starts tests/cuda_pattern with GIB GiB on the GPU
# under bench/mmap_trace_shim (which logs the process's large mappings), profiles the whole
# machine with perf while the driver's lock + checkpoint run, and records: the call's duration,
# how much of the process ended on huge pages, the kernel's THP and compaction counters over the
# call, the top of the profile, and the pattern's own check after restore + unlock.
#
#   BUILD=... TOOLS=... bench/driver_checkpoint_profile.sh OUTDIR GIB "MODE ..."
#     MODE  base          THP as found (madvise here), nothing advised
#           advise        the shim asks for huge pages on each large anonymous mapping at once
#           always        THP enabled=always for the call
#           advise-defer  advise, with defrag=defer (no direct compaction in the fault)
#           preload       the workload runs with libgpusnap-preload.so (parallel populate, huge
#                         pages asked)
#           preload-small the same without huge pages (GPUSNAP_PRELOAD_HUGE_PAGES=0)
#           preload-sync  the library populating before mmap returns (GPUSNAP_PRELOAD_AHEAD=0)
#                         instead of ahead of the driver's copy
#     TOOLS a folder with bin/perf and lib/ (perf's libraries and their loader)
# The host's THP settings are put back at the end. Writes OUTDIR/driver-profile-GIB-MODE.{json,txt}.
set -euo pipefail
OUT=${1:?OUTDIR}; GIB=${2:-4}; MODES=${3:-"base advise always"}
BUILD=${BUILD:-build}; TOOLS=${TOOLS:-}
TOOL=$BUILD/bench/cuda-checkpoint-tool
SHIM=$PWD/$BUILD/bench/mmap_trace_shim.so
PRELOAD=$PWD/$BUILD/libgpusnap-preload.so
THP=/sys/kernel/mm/transparent_hugepage
mkdir -p "$OUT"
enabled_was=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP/enabled")
defrag_was=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP/defrag")
PID=
cleanup() {
  [[ -n $PID ]] && kill -9 "$PID" 2>/dev/null || true
  echo "$enabled_was" >"$THP/enabled" || true
  echo "$defrag_was" >"$THP/defrag" || true
}
trap cleanup EXIT
# perf runs through its own loader, in this process (no wrapper), so that $! is perf itself.
PERF_CMD=("$TOOLS/lib/ld-linux-x86-64.so.2" --library-path "$TOOLS/lib" "$TOOLS/bin/perf")
now() { date +%s.%N; }
since() { python3 -c 'import sys,time; print(f"{time.time()-float(sys.argv[1]):.3f}")' "$1"; }
ask() { exec 3<>"/dev/tcp/127.0.0.1/$1"; printf '%s\n' "$2" >&3; IFS= read -r r <&3; exec 3>&-; printf '%s' "$r"; }
vmstat_snap() { grep -E '^(thp_|compact_|pgfault|pgalloc_normal|numa_hint)' /proc/vmstat | sort; }
for mode in $MODES; do
  echo "$enabled_was" >"$THP/enabled"; echo "$defrag_was" >"$THP/defrag"
  advise=0; preload=$SHIM; huge=1; ahead=1
  case $mode in
    base) ;;
    preload) preload="$SHIM $PRELOAD" ;;
    preload-small) preload="$SHIM $PRELOAD"; huge=0 ;;
    preload-sync) preload="$SHIM $PRELOAD"; ahead=0 ;;
    advise) advise=1 ;;
    always) echo always >"$THP/enabled" ;;
    advise-defer) advise=1; echo defer >"$THP/defrag" ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
  sync; echo 3 >/proc/sys/vm/drop_caches
  ready=$(mktemp -u /tmp/prof-ready.XXXXXX)
  shimlog=$OUT/driver-profile-$GIB-$mode.shim.log
  : >"$shimlog"
  LD_PRELOAD=$preload SHIM_ADVISE=$advise GPUSNAP_PRELOAD_LOG=1 GPUSNAP_PRELOAD_HUGE_PAGES=$huge \
    GPUSNAP_PRELOAD_AHEAD=$ahead \
    "$BUILD/tests/cuda_pattern" --gib "$GIB" --ready-file "$ready" >/dev/null 2>>"$shimlog" &
  PID=$!
  until [[ -s $ready ]]; do sleep 0.05; kill -0 "$PID"; done
  port=$(cat "$ready")
  mark=$(wc -l <"$shimlog")
  vmstat_snap >/tmp/vm-before
  perfdata=/tmp/perf-$GIB-$mode.data
  if [[ -n $TOOLS ]]; then
    "${PERF_CMD[@]}" record -a -e cpu-clock -F 999 -o "$perfdata" >/dev/null 2>&1 &
    PERF=$!; sleep 1
  fi
  export CUDA_CHECKPOINT_TOOL_STAMPS=1
  t=$(now); "$TOOL" lock "$PID" 2>>"$shimlog"; lock=$(since "$t")
  t=$(now); "$TOOL" checkpoint "$PID" 2>>"$shimlog"; ckpt=$(since "$t")
  if [[ -n $TOOLS ]]; then kill -INT "$PERF"; timeout 60 tail --pid="$PERF" -f /dev/null || kill -9 "$PERF"; fi
  vmstat_snap >/tmp/vm-after
  huge_kib=$(awk '/AnonHugePages/ {print $2}' "/proc/$PID/smaps_rollup")
  rss_kib=$(awk '/^Rss/ {print $2}' "/proc/$PID/smaps_rollup")
  t=$(now); "$TOOL" restore "$PID" 2>>"$shimlog"; rest=$(since "$t")
  t=$(now); "$TOOL" unlock "$PID" 2>>"$shimlog"; unl=$(since "$t")
  answer=$(ask "$port" CHECK)
  kill -9 "$PID"; wait "$PID" 2>/dev/null || true; PID=
  deltas=$(join /tmp/vm-before /tmp/vm-after | awk '$3 != $2 {printf "%s\"%s\": %d", sep, $1, $3 - $2; sep=", "}')
  {
    echo "mode $mode, $GIB GiB: lock $lock s, checkpoint $ckpt s, restore $rest s, unlock $unl s"
    echo "vmstat over the call: $deltas"
    echo "the calls (stamp) and the mappings of 1 MiB or more made meanwhile (shim), ns:"
    tail -n +"$((mark + 1))" "$shimlog" | head -60 || true
    echo "... $(tail -n +"$((mark + 1))" "$shimlog" | wc -l) lines in all"
    if [[ -n $TOOLS ]]; then
      echo "--- profile by command and object"
      "${PERF_CMD[@]}" report -n -i "$perfdata" --stdio --sort comm,dso 2>/dev/null | grep -v swapper | grep -v '^#' | grep -v '^$' | head -15 || true
      echo "--- profile by symbol"
      "${PERF_CMD[@]}" report -n -i "$perfdata" --stdio --sort comm,sym 2>/dev/null | grep -v swapper | grep -v '^#' | grep -v '^$' | head -40 || true
    fi
  } >"$OUT/driver-profile-$GIB-$mode.txt"
  rm -f "$perfdata"
  echo "{\"mode\": \"$mode\", \"gib\": $GIB, \"lock_s\": $lock, \"checkpoint_s\": $ckpt, \"restore_s\": $rest, \"unlock_s\": $unl, \"rss_kib\": $rss_kib, \"anon_huge_kib\": $huge_kib, \"vmstat\": {$deltas}, \"answer\": \"$answer\"}" \
    | tee "$OUT/driver-profile-$GIB-$mode.json"
done
