#!/usr/bin/env bash
# Two builds of gpusnap side by side on one GPU machine, in one run: the same PyTorch workload
# (tests/torch_tier.py: GIB GiB of bf16 weights and a CUDA graph) captured once by each build on
# the memory tier and once on the transparent path, then each artifact restored by its own build,
# the builds taking turns round after round (which goes first alternates), each restore timed to
# the copy's first exact answer as bench/tier_bench.sh times it. For "nothing gets slower" after
# a change: BEFORE is the build before it.
#
#   bench/run gpu-tier-before-after GIB OUTDIR BEFORE
#
#   BEFORE  a folder with the earlier build's gpusnap, gpusnap-tier-prefill, libgpusnap-tier.so,
#           libgpusnap-preload.so, python/ and tests/ with torch_tier.py and the modules it
#           imports from beside it (torch_graph.py, line_server.py, gpusnap_handshake.py): a
#           build folder, or those files copied out of one; the later build is BUILD (default build)
#   BENCH_RUNS    rounds on the tier (default 4); BENCH_PLAIN_RUNS on the transparent path
#                 (default 2); 0 leaves either path out
#   BENCH_CAPTURE_FIRST  which build captures first (before, the default, or after): the second
#                 artifact's tmpfs pages are allocated after the first's, which can change how
#                 fast the driver reads them back; swapping the order tells that from the build
# Results: OUTDIR/run.log, written as it goes (each restore's phases and the prefill's note),
# every command's JSON beside it, and the medians at the end.
set -uo pipefail
GIB=${1:?GIB}; OUT=${2:?OUTDIR}; BEFORE=$(readlink -f "${3:?BEFORE}")
AFTER=$(readlink -f "${BUILD:-build}")
RUNS=${BENCH_RUNS:-4}; PLAIN_RUNS=${BENCH_PLAIN_RUNS:-2}
FIRST=${BENCH_CAPTURE_FIRST:-before}
case $FIRST in before) SECOND=after ;; after) SECOND=before ;;
  *) echo "tier_before_after: BENCH_CAPTURE_FIRST is before or after, not $FIRST" >&2; exit 2 ;; esac
[[ $(id -u) == 0 ]] || { echo "tier_before_after: run as root" >&2; exit 1; }
for b in "$BEFORE" "$AFTER"; do
  for f in gpusnap gpusnap-tier-prefill libgpusnap-tier.so libgpusnap-preload.so tests/torch_tier.py \
      tests/torch_graph.py tests/line_server.py tests/gpusnap_handshake.py; do
    [[ -e $b/$f ]] || { echo "tier_before_after: $b/$f is missing" >&2; exit 1; }
  done
done
mkdir -p "$OUT"; OUT=$(readlink -f "$OUT")
exec > >(tee -a "$OUT/run.log") 2>&1
S=$(mktemp -d /tmp/gpusnap-before-after.XXXXXX)
mount -t tmpfs -o huge=within_size,size=$(( GIB * 4 + 8 ))g gpusnap-before-after "$S"
# The helpers of the registry scenarios (now, el, ask, host_port, gpu_idle; cleanup ends the
# copies in INITS and removes W), without a registry.
W=$S/work
# shellcheck disable=SC2034  # REGDIR is read by cleanup (gpu_registry_lib.sh)
REGDIR=""
mkdir -p "$W"
# shellcheck source=bench/gpu_registry_lib.sh
source "$(dirname "$(readlink -f "$0")")/gpu_registry_lib.sh"
trap 'cleanup; umount -l "$S"; rmdir "$S"' EXIT
declare -A BIN=([before]=$BEFORE [after]=$AFTER)
summary() {  # the phases of a command's JSON, and its notes
  echo "   phases: $(phases "$1") seconds=$(field "$1" "['seconds']")"
  python3 -c 'import json, sys; [print("   note: " + n) for n in json.load(open(sys.argv[1])).get("notes", [])]' \
    "$1" 2>/dev/null
}
WEIGHTS=$W/weights.bin
capture() {  # BUILD PATH: `gpusnap run` to READY, then its checkpoint
  local b=$1 p=$2 flag t; [[ $p == tier ]] && flag=--tier || flag=--no-tier
  t=$(now)
  timeout 300 "${BIN[$b]}/gpusnap" run -o "$W/$b-$p" --json -- python3 "${BIN[$b]}/tests/torch_tier.py" \
    "$flag" --gib "$GIB" --weights "$WEIGHTS" --ready-file "$W/$b-$p.port" \
    >"$OUT/$b-$p-run.json" 2>"$OUT/$b-$p-run.err"
  echo "capture $b $p: rc=$? $(el "$t") s"
}
RESULTS=$OUT/restores.jsonl
: >"$RESULTS"
restore() {  # BUILD PATH ROUND: its own artifact, to the first exact answer
  local b=$1 p=$2 r=$3 name="$1-$2-$3"
  gpu_idle
  local t; t=$(now)
  timeout 120 "${BIN[$b]}/gpusnap" restore "$W/$b-$p" --publish "$(cat "$W/$b-$p.port")" --json \
    >"$OUT/$name.json" 2>"$OUT/$name.err"
  local rc=$? cmd; cmd=$(el "$t")
  local answer; answer=$(ask "$(host_port "$OUT/$name.json")" CHECK)
  local first; first=$(el "$t")
  echo "$p $b round $r: rc=$rc, first answer $first s (the command $cmd s): $answer"
  summary "$OUT/$name.json"
  [[ $r == 1 ]] && echo "   VERIFY $(ask "$(host_port "$OUT/$name.json")" VERIFY)"
  local init; init=$(grep -o '"init_pid": *[0-9]*' "$OUT/$name.json" | head -1 | grep -o '[0-9]*$')
  [[ -n $init ]] && { INITS+=("$init"); kill -9 "$init" 2>/dev/null; }
  [[ $answer == "OK max_err=0 "* ]] && echo "{\"build\": \"$b\", \"path\": \"$p\", \"first_answer_s\": $first, \"command_s\": $cmd}" >>"$RESULTS"
}
rounds() {  # PATH N
  local p=$1 r
  for r in $(seq "$2"); do
    if (( r % 2 )); then restore before "$p" "$r"; restore after "$p" "$r"
    else restore after "$p" "$r"; restore before "$p" "$r"; fi
  done
}
# The weights file first (the workload makes it when missing), untimed.
timeout 300 "$AFTER/gpusnap" run -o "$W/warm" --json -- python3 "$AFTER/tests/torch_tier.py" --no-tier \
  --gib "$GIB" --weights "$WEIGHTS" >"$OUT/warm.json" 2>"$OUT/warm.err"
rm -rf "$W/warm"
if (( RUNS > 0 )); then
  capture "$FIRST" tier; capture "$SECOND" tier
  rounds tier "$RUNS"
  rm -rf "$W"/before-tier "$W"/after-tier
fi
if (( PLAIN_RUNS > 0 )); then
  capture "$FIRST" transparent; capture "$SECOND" transparent
  rounds transparent "$PLAIN_RUNS"
fi
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for p in ("tier", "transparent"):
    for b in ("before", "after"):
        t = [r["first_answer_s"] for r in rows if r["path"] == p and r["build"] == b]
        c = [r["command_s"] for r in rows if r["path"] == p and r["build"] == b]
        if t:
            print(f"{p} {b}: first answer {sorted(t)} median {statistics.median(t)} s; "
                  f"the command median {statistics.median(c)} s")
PY
