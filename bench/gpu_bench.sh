#!/usr/bin/env bash
# The GPU benchmark of docs/benchmarks.md: cold start, the plain pipeline and gpusnap, side by
# side in one run on one GPU machine, for the PyTorch workload (tests/gpu/workloads/
# torch_graph.py: weights from a file onto the GPU, forward pass captured in a CUDA graph).
#
#   bench/run gpu OUTDIR [SIZES] [STORAGES]
#     SIZES     GPU state sizes in GiB (default "4 16")
#     STORAGES  where the artifacts live: ram (/dev/shm), ram-thp (a tmpfs the bench mounts
#               with huge=within_size: 2 MiB pages, as a node's artifact store can be set up)
#               and/or disk ($DISK_DIR, default /var/tmp); default "ram disk". For disk, the
#               page cache is dropped before each restore when this machine allows it
#               (recorded as cache_dropped).
#
# For each size and storage, two starts of the same workload:
#   cold     launch to first correct answer (the weights file already in the page cache): the
#            plain pipeline's source start
#   plain    driver lock + checkpoint (cuda-checkpoint-tool), `criu dump`; `criu restore`,
#            driver restore + unlock, first answer: the anchors' pipeline, no gpusnap
#   gpusnap  `gpusnap checkpoint`; `gpusnap restore` to the copy's first correct answer. Its
#            source runs with libgpusnap-preload.so, as `gpusnap run` and `gpusnap init` start
#            workloads (PRELOAD=0: without it, as a workload started by hand); its own launch to
#            first answer is recorded too (source_start_s), to show what the library costs there
# A correct answer is the CUDA graph's output equal, bit for bit, to the one computed before the
# checkpoint. Each case writes OUTDIR/gpu-bench-SIZE-STORAGE.json; the report (table + PNG) is
# made by bench/gpu_bench_report.py at the end.
#
# Run by `bench/run gpu`, which builds what it needs. Needs: BUILD (default build) with gpusnap,
# bench/cuda-checkpoint-tool and tests/torch_graph.py; GPUSNAP_CRIU (or /opt/gpusnap/criu/criu); python3 with torch.
set -euo pipefail
OUT=${1:?OUTDIR}; SIZES=${2:-"4 16"}; STORAGES=${3:-"ram disk"}
BUILD=${BUILD:-build}
CRIU=${GPUSNAP_CRIU:-/opt/gpusnap/criu/criu}
TOOL=$BUILD/bench/cuda-checkpoint-tool
GPUSNAP=$BUILD/gpusnap
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
# The weights: the workload's own input, made once and kept for later runs.
INPUT=${WEIGHTS_DIR:-/dev/shm/gpusnap-bench-weights}; mkdir -p "$INPUT"
KILL=(); DIRS=(); MOUNTS=()
cleanup() {
  for p in "${KILL[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "${DIRS[@]}"
  for m in "${MOUNTS[@]}"; do umount "$m" && rmdir "$m" || true; done
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { python3 -c 'import sys,time; print(f"{time.time()-float(sys.argv[1]):.3f}")' "$1"; }
ask() { exec 3<>"/dev/tcp/127.0.0.1/$1"; printf '%s\n' "$2" >&3; IFS= read -r r <&3; exec 3>&-; printf '%s' "$r"; }
jget() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval("d"+sys.argv[2]))' "$1" "$2"; }
drop_cache() {  # prints true when the page cache was dropped
  sync
  if echo 3 2>/dev/null >/proc/sys/vm/drop_caches; then echo true; else echo false; fi
}

start_source() {  # start_source GIB NAME [VAR=VALUE...]: sets SRC, PORT, COLD (launch to first answer)
  local gib=$1 name=$2; shift 2
  rm -f "$INPUT/$name.ready"
  local t0; t0=$(now)
  setsid env "$@" python3 "$BUILD/tests/torch_graph.py" --gib "$gib" --weights "$INPUT/w$gib.bin" \
    --ready-file "$INPUT/$name.ready" </dev/null >"$INPUT/$name.log" 2>&1 &
  SRC=$!; KILL+=("$SRC")
  until [[ -f $INPUT/$name.ready ]]; do
    sleep 0.05; kill -0 $SRC 2>/dev/null || { cat "$INPUT/$name.log"; exit 1; }
  done
  PORT=$(cat "$INPUT/$name.ready")
  local first; first=$(ask "$PORT" CHECK)
  COLD=$(since "$t0")
  [[ $first == "OK max_err=0"* ]] || { echo "source answered $first" >&2; exit 1; }
}

for STORAGE in $STORAGES; do
  case $STORAGE in
    ram) BASE=/dev/shm ;;
    ram-thp)
      BASE=$(mktemp -d /run/gpusnap-bench-thp.XXXXXX)
      mount -t tmpfs -o huge=within_size,size=100G gpusnap-bench-thp "$BASE"; MOUNTS+=("$BASE") ;;
    disk) BASE=${DISK_DIR:-/var/tmp} ;;
    *) echo "unknown storage '$STORAGE' (ram, ram-thp or disk)" >&2; exit 2 ;;
  esac
  FSTYPE=$(stat -f -c %T "$BASE")
  for GIB in $SIZES; do
    WORK=$(mktemp -d "$BASE/gpusnap-bench.XXXXXX"); DIRS+=("$WORK")
    # The weights file (made once per size); this start also warms the page cache.
    [[ -f $INPUT/w$GIB.bin ]] || { start_source "$GIB" warm; kill -9 "$SRC"; wait "$SRC" 2>/dev/null || true; }

    # --- plain (its start is the cold start: launch to first answer, weights in the page cache)
    start_source "$GIB" plain; cold=$COLD
    t=$(now); "$TOOL" lock "$SRC"; "$TOOL" checkpoint "$SRC"; p_gpu_ckpt=$(since "$t")
    t=$(now); mkdir -p "$WORK/plain"
    "$CRIU" dump -t "$SRC" -D "$WORK/plain" --tcp-established --ext-unix-sk --file-locks \
      --network-lock skip -v4 -o "$WORK/plain-dump.log" ||
      { grep Error "$WORK/plain/plain-dump.log" | tail; exit 1; }
    p_dump=$(since "$t"); wait "$SRC" 2>/dev/null || true
    sync; p_bytes=$(du -sb "$WORK/plain" | cut -f1)
    p_dropped=false; [[ $STORAGE == disk ]] && p_dropped=$(drop_cache)
    t=$(now)
    "$CRIU" restore -D "$WORK/plain" -d --tcp-established --ext-unix-sk --file-locks \
      --pidfile "$WORK/plain.pid" -v4 -o "$WORK/plain-restore.log"
    p_criu_restore=$(since "$t")
    RPID=$(cat "$WORK/plain.pid"); KILL+=("$RPID")
    t2=$(now); "$TOOL" restore "$RPID"; "$TOOL" unlock "$RPID"; p_gpu_restore=$(since "$t2")
    p_answer=$(ask "$PORT" CHECK); p_total=$(since "$t")
    kill -9 "$RPID"; rm -rf "$WORK/plain"

    # --- gpusnap (the source is stopped once captured, as in the plain pipeline)
    if [[ ${PRELOAD:-1} == 1 ]]; then
      start_source "$GIB" gs "LD_PRELOAD=$(cd "$BUILD" && pwd)/libgpusnap-preload.so" GPUSNAP_PRELOAD_LOG=1
    else
      start_source "$GIB" gs
    fi
    g_cold=$COLD
    t=$(now)
    "$GPUSNAP" checkpoint --pid "$SRC" -o "$WORK/gs" --json >"$WORK/gs-cp.json" 2>"$WORK/gs-cp.err"
    g_ckpt=$(since "$t"); wait "$SRC" 2>/dev/null || true
    cp "$WORK/gs-cp.json" "$OUT/gpusnap-checkpoint-$GIB-$STORAGE.json"
    sync
    g_apparent=$(du -sb "$WORK/gs" | cut -f1); g_allocated=$(du -sB1 "$WORK/gs" | cut -f1)
    # Where the driver put the region: a 2 MiB aligned start lets its file be mapped with huge pages.
    g_starts=$(python3 -c 'import json,sys; print([hex(i["start"]) for i in json.load(open(sys.argv[1])).get("host_images", [])])' "$WORK/gs/manifest.json" 2>/dev/null || echo '[]')
    g_huge_kib=$(awk '/ShmemHugePages/ {print $2}' /proc/meminfo)
    g_dropped=false; [[ $STORAGE == disk ]] && g_dropped=$(drop_cache)
    t=$(now)
    "$GPUSNAP" restore "$WORK/gs" --publish "$PORT" --json >"$WORK/gs-rs.json" 2>"$WORK/gs-rs.err"
    # (The port is read with sed, not python: no interpreter start inside the timing.)
    g_answer=$(ask "$(sed -n 's/.*"host_port": \([0-9]*\).*/\1/p' "$WORK/gs-rs.json" | head -1)" CHECK)
    g_total=$(since "$t")
    cp "$WORK/gs-rs.json" "$OUT/gpusnap-restore-$GIB-$STORAGE.json"
    INIT=$(jget "$WORK/gs-rs.json" "['copies'][0]['init_pid']"); KILL+=("$INIT")
    # Whether the copy still maps its host image once the driver has restored it.
    COPY=$(jget "$WORK/gs-rs.json" "['copies'][0]['pid']")
    image_maps=$(grep -c "host-images" "/proc/$COPY/maps" 2>/dev/null || true)
    kill -9 "$INIT"
    python3 - "$GIB" "$STORAGE" "$FSTYPE" "$WORK" "$OUT" <<PY
import json, sys
gib, storage, fstype, work, out = sys.argv[1:]
cp, rs = json.load(open(work + "/gs-cp.json")), json.load(open(work + "/gs-rs.json"))
doc = {"gib": float(gib), "storage": storage, "fs": fstype, "cold_start_s": $cold,
       "plain": {"gpu_lock_checkpoint_s": $p_gpu_ckpt, "criu_dump_s": $p_dump,
                 "checkpoint_s": round($p_gpu_ckpt + $p_dump, 3), "artifact_bytes": $p_bytes,
                 "cache_dropped": "$p_dropped" == "true", "criu_restore_s": $p_criu_restore,
                 "gpu_restore_unlock_s": $p_gpu_restore, "restore_to_answer_s": $p_total,
                 "answer": "$p_answer"},
       "gpusnap": {"preload": "${PRELOAD:-1}" == "1", "source_start_s": $g_cold,
                   "preload_log": [l for l in open("$INPUT/gs.log").read().splitlines()
                                   if l.startswith("gpusnap-preload")],
                   "checkpoint_s": $g_ckpt, "restore_to_answer_s": $g_total,
                   "artifact_apparent_bytes": $g_apparent, "artifact_allocated_bytes": $g_allocated,
                   "cache_dropped": "$g_dropped" == "true", "answer": "$g_answer",
                   "shmem_huge_kib_after_checkpoint": $g_huge_kib,
                   "host_image_starts": $g_starts,
                   "copy_maps_host_image_after_restore": "${image_maps:-0}" not in ("", "0"),
                   "checkpoint_notes": open(work + "/gs-cp.err").read().splitlines()[-20:],
                   "checkpoint": cp, "restore": rs}}
json.dump(doc, open(f"{out}/gpu-bench-{gib}-{storage}.json", "w"), indent=1)
short = {k: v for k, v in doc.items() if k != "gpusnap"}
short["gpusnap"] = {k: v for k, v in doc["gpusnap"].items() if k not in ("checkpoint", "restore", "checkpoint_notes")}
print(json.dumps(short))
PY
    if [[ -n ${COMPRESS_BENCH:-} && -x $BUILD/bench/gpusnap-compress-bench ]]; then
      "$BUILD/bench/gpusnap-compress-bench" --json "$WORK/gs" >"$OUT/compress-$GIB-$STORAGE.json" || true
    fi
    rm -rf "$WORK"
  done
done
python3 "$HERE/gpu_bench_report.py" "$OUT" || echo "report: run bench/gpu_bench_report.py $OUT where matplotlib is installed" >&2
