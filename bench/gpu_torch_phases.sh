#!/usr/bin/env bash
# The PyTorch workload's checkpoint and restore phases on a GPU machine, beside its cold start:
# one run, one machine. Usage: bench/gpu_torch_phases.sh GIB OUTDIR [IMAGEDIR]
#   GIB       GPU state size (weights) in GiB, e.g. 16
#   OUTDIR    where the JSON results go (torch-GIB.json)
#   IMAGEDIR  where the artifact is written (default /dev/shm: RAM, as the baseline measured)
# Needs: gpusnap and tests/torch_graph.py in the build tree (BUILD, default build), CRIU
# (GPUSNAP_CRIU or /opt/gpusnap/criu/criu), python3 with torch. (No jq or bc: GPU machines
# have neither.)
set -euo pipefail
GIB=${1:?GIB}; OUTDIR=${2:?OUTDIR}; IMAGES=${3:-/dev/shm}
BUILD=${BUILD:-build}
GPUSNAP=$BUILD/gpusnap
WORK=$(mktemp -d "$IMAGES/gpusnap-bench.XXXXXX")
SRC=""
INIT=""
cleanup() {
  [[ -n $SRC ]] && kill -9 "$SRC" 2>/dev/null || true
  [[ -n $INIT ]] && kill -9 "$INIT" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$(now)"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
ask() {  # ask PORT COMMAND
  exec 3<>"/dev/tcp/127.0.0.1/$1"; printf '%s\n' "$2" >&3; IFS= read -r r <&3; exec 3>&-; printf '%s' "$r"
}

WEIGHTS=$WORK/weights.bin
# Make the weights file first so the cold start below reads it as a server reads its model.
python3 "$BUILD/tests/torch_graph.py" --gib "$GIB" --weights "$WEIGHTS" --ready-file "$WORK/warm" \
  </dev/null >"$WORK/warm.log" 2>&1 &
warm=$!
until [[ -f $WORK/warm ]]; do sleep 0.2; kill -0 $warm 2>/dev/null || { cat "$WORK/warm.log"; exit 1; }; done
kill -9 $warm; wait $warm 2>/dev/null || true

t0=$(now)
setsid python3 "$BUILD/tests/torch_graph.py" --gib "$GIB" --weights "$WEIGHTS" \
  --ready-file "$WORK/ready" </dev/null >"$WORK/source.log" 2>&1 &
SRC=$!
until [[ -f $WORK/ready ]]; do sleep 0.05; done
PORT=$(cat "$WORK/ready")
first=$(ask "$PORT" CHECK)
t_cold=$(elapsed "$t0")
echo "cold start to first correct answer: $t_cold s ($first)" >&2

"$GPUSNAP" checkpoint --pid "$SRC" -o "$WORK/snap" --json >"$WORK/checkpoint.json"
SRC=""
t1=$(now)
"$GPUSNAP" restore "$WORK/snap" --publish "$PORT" --json >"$WORK/restore.json"
INIT=$(field "$WORK/restore.json" "['copies'][0]['init_pid']")
answer=$(ask "$(field "$WORK/restore.json" "['copies'][0]['ports'][0]['host_port']")" CHECK)
t_restore=$(elapsed "$t1")
echo "restore to first correct answer: $t_restore s ($answer)" >&2
size=$(du -sb "$WORK/snap" | cut -f1)
python3 - "$GIB" "$t_cold" "$t_restore" "$answer" "$size" "$WORK" <<'PY' | tee "$OUTDIR/torch-$GIB.json"
import json, sys
gib, cold, restore, answer, size, work = sys.argv[1:]
print(json.dumps({"gib": float(gib), "cold_start_s": float(cold), "restore_to_answer_s": float(restore),
                  "answer": answer, "artifact_bytes": int(size),
                  "checkpoint": json.load(open(work + "/checkpoint.json")),
                  "restore": json.load(open(work + "/restore.json"))}, indent=1))
PY
