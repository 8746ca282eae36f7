#!/usr/bin/env bash
# The plain pipeline (criu CLI + the driver's checkpoint API, as the anchors run it) against
# gpusnap, side by side in one run on one GPU machine, for the PyTorch workload
# (tests/gpu/workloads/torch_graph.py: weights from a file, forward pass in a CUDA graph).
#   bench/gpu_plain_vs_gpusnap.sh OUTDIR "4 16"     sizes in GiB; artifacts in /dev/shm (RAM)
# Each restore is timed from the command to the copy's first correct answer (graph replay
# equal, bit for bit, to the answer computed before the checkpoint). Needs BUILD (default build)
# with gpusnap, bench/cuda-checkpoint-tool and tests/torch_graph.py; GPUSNAP_CRIU; python3+torch.
set -euo pipefail
OUT=${1:?OUTDIR}; SIZES=${2:-"4 16"}
BUILD=${BUILD:-build}
CRIU=${GPUSNAP_CRIU:-/opt/gpusnap/criu/criu}
TOOL=$BUILD/bench/cuda-checkpoint-tool
WORK=$(mktemp -d /dev/shm/gpusnap-plain.XXXXXX)
KILL=()
cleanup() { for p in "${KILL[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
now() { date +%s.%N; }
since() { python3 -c 'import sys,time; print(f"{time.time()-float(sys.argv[1]):.2f}")' "$1"; }
ask() { exec 3<>"/dev/tcp/127.0.0.1/$1"; printf '%s\n' "$2" >&3; IFS= read -r r <&3; exec 3>&-; printf '%s' "$r"; }
jget() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval("d"+sys.argv[2]))' "$1" "$2"; }

start_source() {  # start_source GIB NAME: cold start to the first correct answer
  local gib=$1 name=$2
  rm -f "$WORK/$name.ready"
  local t0; t0=$(now)
  setsid python3 "$BUILD/tests/torch_graph.py" --gib "$gib" --weights "$WORK/w$gib.bin" \
    --ready-file "$WORK/$name.ready" </dev/null >"$WORK/$name.log" 2>&1 &
  SRC=$!; KILL+=("$SRC")
  until [[ -f $WORK/$name.ready ]]; do sleep 0.05; kill -0 $SRC 2>/dev/null || { cat "$WORK/$name.log"; exit 1; }; done
  PORT=$(cat "$WORK/$name.ready")
  local first; first=$(ask "$PORT" CHECK)
  COLD=$(since "$t0")
  [[ $first == "OK max_err=0"* ]] || { echo "source answered $first" >&2; exit 1; }
}

for GIB in $SIZES; do
  # The weights file, made once; the first start also warms the page cache for both runs.
  start_source "$GIB" warm; kill -9 "$SRC"; wait "$SRC" 2>/dev/null || true

  # --- plain: driver lock + checkpoint, criu dump (kills the source), criu restore, driver
  # restore + unlock, first answer.
  start_source "$GIB" plain; cold_plain=$COLD
  t=$(now); "$TOOL" lock "$SRC"; "$TOOL" checkpoint "$SRC"; p_gpu_ckpt=$(since "$t")
  t=$(now)
  mkdir -p "$WORK/plain"
  "$CRIU" dump -t "$SRC" -D "$WORK/plain" --tcp-established --ext-unix-sk --file-locks \
    --network-lock skip -v4 -o "$WORK/plain-dump.log" || { grep Error "$WORK/plain/plain-dump.log" | tail; exit 1; }
  p_dump=$(since "$t"); wait "$SRC" 2>/dev/null || true
  plain_bytes=$(du -sb "$WORK/plain" | cut -f1)
  t=$(now)
  "$CRIU" restore -D "$WORK/plain" -d --tcp-established --ext-unix-sk --file-locks \
    --pidfile "$WORK/plain.pid" -v4 -o "$WORK/plain-restore.log"
  p_criu_restore=$(since "$t")
  RPID=$(cat "$WORK/plain.pid"); KILL+=("$RPID")
  t2=$(now); "$TOOL" restore "$RPID"; "$TOOL" unlock "$RPID"; p_gpu_restore=$(since "$t2")
  answer_plain=$(ask "$PORT" CHECK); p_total=$(since "$t")
  kill -9 "$RPID"; rm -rf "$WORK/plain"

  # --- gpusnap: the same workload, checkpoint (source stopped) and one copy.
  start_source "$GIB" gs; cold_gs=$COLD
  t=$(now); "$BUILD/gpusnap" checkpoint --pid "$SRC" -o "$WORK/gs" --json >"$WORK/gs-cp.json"
  g_ckpt=$(since "$t"); wait "$SRC" 2>/dev/null || true
  t=$(now); "$BUILD/gpusnap" restore "$WORK/gs" --publish "$PORT" --json >"$WORK/gs-rs.json"
  KILL+=("$(jget "$WORK/gs-rs.json" "['copies'][0]['init_pid']")")
  answer_gs=$(ask "$(jget "$WORK/gs-rs.json" "['copies'][0]['ports'][0]['host_port']")" CHECK)
  g_total=$(since "$t")
  kill -9 "$(jget "$WORK/gs-rs.json" "['copies'][0]['init_pid']")"
  python3 - "$GIB" "$WORK" "$OUT" <<PY
import json, sys
gib, work, out = sys.argv[1:]
cp, rs = json.load(open(work + "/gs-cp.json")), json.load(open(work + "/gs-rs.json"))
doc = {"gib": float(gib),
       "plain": {"cold_start_s": $cold_plain, "gpu_lock_checkpoint_s": $p_gpu_ckpt, "criu_dump_s": $p_dump,
                 "checkpoint_s": round($p_gpu_ckpt + $p_dump, 2), "artifact_bytes": $plain_bytes,
                 "criu_restore_s": $p_criu_restore, "gpu_restore_unlock_s": $p_gpu_restore,
                 "restore_to_answer_s": $p_total, "answer": "$answer_plain"},
       "gpusnap": {"cold_start_s": $cold_gs, "checkpoint_s": $g_ckpt, "restore_to_answer_s": $g_total,
                   "answer": "$answer_gs", "checkpoint": cp, "restore": rs}}
json.dump(doc, open(f"{out}/plain-vs-gpusnap-{gib}.json", "w"), indent=1)
print(json.dumps({k: (v if k != "gpusnap" else {kk: vv for kk, vv in v.items() if kk not in ("checkpoint", "restore")}) for k, v in doc.items()}))
PY
  rm -rf "$WORK/gs"
done
