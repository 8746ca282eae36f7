#!/usr/bin/env bash
# The memory tier against the transparent path, side by side in one run on one GPU machine:
# the same PyTorch workload (tests/torch_tier.py: GIB GiB of bf16 weights and a CUDA graph,
# speaking the handshake), captured by `gpusnap run` and restored by `gpusnap restore`, once on
# PyTorch's own allocator (the driver's checkpoint carries the memory) and once with
# gpusnap_handshake.use_memory_tier() (the tier drains and fills it itself).
#
#   bench/run gpu-tier GIB OUTDIR [STORE]
#
#   GIB     weights in GiB (16 for the target: restore <= 1.0 s, capture <= 2.0 s)
#   OUTDIR  results: tier-GIB.json (every run) and tier-GIB.md (the table), logs in tier-GIB-logs/
#   STORE   where artifacts go; default a huge-page tmpfs (huge=within_size) the script mounts
#           and unmounts. A disk path with BENCH_COLD=1 measures a cold page cache instead: the
#           cache is dropped before each restore and the disk's own read speed is measured on
#           the tier's files in the same run (dd, O_DIRECT).
#
# Per round (BENCH_RUNS, default 3; the two paths alternate which goes first):
#   capture   `gpusnap run` to READY, then its checkpoint (source stopped): phases from --json;
#             `pause` is the tier's drain (GPU -> files) on the tier path
#   restore   wall time from `gpusnap restore --publish` to the first correct CHECK (the CUDA
#             graph replayed, bit-exact against the answer computed before the capture);
#             phases from --json; `resume` is the tier's fill (files -> GPU) on the tier path;
#             VERIFY (every weight against the file, untimed) must answer OK
#   copies    BENCH_COPIES (default "2 4"; "" for none): that many copies of the tier artifact
#             restored at once onto GPU 0, wall time to every copy's correct CHECK
# Drain and fill rates are the tier's bytes over those phases; GPUSNAP_TIER_LOG=1 also has the
# workload print them on its stderr (the run's log).
# Needs: BUILD (default build) with gpusnap, libgpusnap-preload.so, libgpusnap-tier.so and
# tests/torch_tier.py; CRIU (GPUSNAP_CRIU or /opt/gpusnap/criu/criu); python3 with torch;
# nvidia-smi. No jq.
set -euo pipefail
GIB=${1:?GIB}; OUTDIR=${2:?OUTDIR}; STORE=${3:-}
BUILD=${BUILD:-build}
RUNS=${BENCH_RUNS:-3}
COPIES=${BENCH_COPIES-2 4}
COLD=${BENCH_COLD:-0}
GPUSNAP=$(readlink -f "$BUILD/gpusnap")
WORKLOAD=$(readlink -f "$BUILD/tests/torch_tier.py")
export GPUSNAP_TIER_LOG=1
[[ $(id -u) == 0 ]] || { echo "tier_bench: run as root" >&2; exit 1; }
for f in "$GPUSNAP" "$WORKLOAD" "$BUILD/libgpusnap-tier.so" "$BUILD/libgpusnap-preload.so"; do
  [[ -e $f ]] || { echo "tier_bench: $f is missing: build first" >&2; exit 1; }
done
mkdir -p "$OUTDIR"
LOGS=$(readlink -f "$OUTDIR")/tier-$GIB-logs
mkdir -p "$LOGS"
MOUNTED=""
if [[ -z $STORE ]]; then
  STORE=$(mktemp -d /tmp/gpusnap-tier-store.XXXXXX)
  mount -t tmpfs -o huge=within_size,size=$(( (GIB * 3 + 8) ))g tmpfs "$STORE"
  MOUNTED=$STORE
fi
WORK=$(mktemp -d "$STORE/gpusnap-tier-bench.XXXXXX")
INITS=()
cleanup() {
  local pid
  for pid in "${INITS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
  [[ -n $MOUNTED ]] && { umount "$MOUNTED"; rmdir "$MOUNTED"; }
  return 0
}
trap cleanup EXIT
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$(now)"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
ask() {  # ask PORT COMMAND
  exec 3<>"/dev/tcp/127.0.0.1/$1"; printf '%s\n' "$2" >&3; IFS= read -r r <&3; exec 3>&-; printf '%s' "$r"
}
# A killed copy gives its GPU memory back while the driver tears its context down (0.4-0.5 s
# for four 17 GB copies on the H200). So that no restore below runs beside a teardown,
# each first waits (at most 30 s) until no process holds the GPU, and says how long it waited.
gpu_idle() {
  local t; t=$(now)
  for _ in $(seq 600); do
    [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) ]] && break
    sleep 0.05
  done
  echo "the GPU was free after $(elapsed "$t") s" >&2
}
tier_bytes() {  # bytes of ARTIFACT's files under tier/
  python3 -c "import json,sys; print(sum(f['size'] for f in json.load(open(sys.argv[1]+'/manifest.json'))['files'] if f['path'].startswith('tier/')))" "$1"
}

WEIGHTS=$WORK/weights.bin
# The weights file first (the workload makes it when missing), so that every capture below
# loads the same bytes; the first capture's run is untimed.
"$GPUSNAP" run -o "$WORK/warm" --json -- python3 "$WORKLOAD" --no-tier --gib "$GIB" \
  --weights "$WEIGHTS" >"$LOGS/warm.json" 2>"$LOGS/warm.err"
rm -rf "$WORK/warm"

RESULTS=$LOGS/runs.jsonl
: >"$RESULTS"
# The port of copy 0 in a restore's JSON, without starting a Python (whose start-up would
# count in the time to the first answer).
host_port() { grep -o '"host_port": *[0-9]*' "$1" | head -1 | grep -o '[0-9]*$'; }
restore_and_check() {  # MODE ROUND ARTIFACT-NAME DISK-GBS: one restore, timed to the first answer
  local mode=$1 round=$2 name=$3 disk_gbs=$4
  gpu_idle
  local t1; t1=$(now)
  "$GPUSNAP" restore "$WORK/$name" --publish "$(cat "$WORK/$name.port")" --json \
    >"$LOGS/$mode-$round-restore.json" 2>"$LOGS/$mode-$round-restore.err"
  local t2; t2=$(now)
  local hport; hport=$(host_port "$LOGS/$mode-$round-restore.json")
  local answer; answer=$(ask "$hport" CHECK)
  local t_restore; t_restore=$(elapsed "$t1")
  local t_command; t_command=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$t1" "$t2")
  INITS+=("$(field "$LOGS/$mode-$round-restore.json" "['copies'][0]['init_pid']")")
  local verify; verify=$(ask "$hport" VERIFY)
  kill -9 "${INITS[-1]}" 2>/dev/null || true
  python3 - "$mode" "$round" "$t_restore" "$answer" "$verify" "$(tier_bytes "$WORK/$name")" \
    "$LOGS/$name-run.json" "$LOGS/$mode-$round-restore.json" "$disk_gbs" "$t_command" >>"$RESULTS" <<'PY'
import json, sys
mode, rnd, t, answer, verify, tb, run, restore, disk, tc = sys.argv[1:]
run, restore = json.load(open(run)), json.load(open(restore))
print(json.dumps({"mode": mode, "round": int(rnd), "restore_to_answer_s": float(t),
                  "restore_command_s": float(tc), "answer": answer,
                  "verify": verify, "tier_bytes": int(tb), "disk_read_gbs": json.loads(disk),
                  "run": run, "restore": restore}))
PY
  echo "$mode round $round: restore to first correct answer $t_restore s (the command $t_command s; $answer; VERIFY $verify)" >&2
}
one() {  # one MODE ROUND: capture, restore, check
  local mode=$1 round=$2 name="$1-$2" flag
  [[ $mode == tier ]] && flag=--tier || flag=--no-tier
  "$GPUSNAP" run -o "$WORK/$name" --json -- python3 "$WORKLOAD" "$flag" --gib "$GIB" \
    --weights "$WEIGHTS" --ready-file "$WORK/$name.port" >"$LOGS/$name-run.json" 2>"$LOGS/$name-run.err"
  local disk_gbs=null
  if [[ $COLD == 1 ]]; then
    sync
    if [[ $mode == tier ]]; then
      echo 3 >/proc/sys/vm/drop_caches
      local t b; t=$(now); b=$(tier_bytes "$WORK/$name")
      cat "$WORK/$name"/tier/*.img | dd of=/dev/null bs=16M iflag=direct status=none 2>/dev/null \
        || cat "$WORK/$name"/tier/*.img >/dev/null
      disk_gbs=$(python3 -c "import sys; print(round(int(sys.argv[1]) / float(sys.argv[2]) / 1e9, 2))" "$b" "$(elapsed "$t")")
    fi
    echo 3 >/proc/sys/vm/drop_caches
  fi
  restore_and_check "$mode" "$round" "$name" "$disk_gbs"
  # The tier's artifact restored again with its fill in the copy (no prefill), side by side.
  if [[ $mode == tier ]]; then
    if [[ $COLD == 1 ]]; then sync; echo 3 >/proc/sys/vm/drop_caches; fi
    GPUSNAP_TIER_PREFILL=off restore_and_check tier-no-prefill "$round" "$name" "$disk_gbs"
  fi
  rm -rf "${WORK:?}/$name"
}
for round in $(seq 1 "$RUNS"); do
  if (( round % 2 )); then one transparent "$round"; one tier "$round"; else one tier "$round"; one transparent "$round"; fi
done

# Several copies of one tier artifact at once, onto GPU 0.
MULTI=$LOGS/copies.jsonl
: >"$MULTI"
[[ -z ${COPIES// /} ]] || "$GPUSNAP" run -o "$WORK/multi" --json -- python3 "$WORKLOAD" --tier \
  --gib "$GIB" --weights "$WEIGHTS" --ready-file "$WORK/multi.port" >"$LOGS/multi-run.json" \
  2>"$LOGS/multi-run.err"
for n in $COPIES; do
  gpu_idle
  t1=$(now)
  if "$GPUSNAP" restore "$WORK/multi" --replicas "$n" --publish "$(cat "$WORK/multi.port")" --json \
      >"$LOGS/copies-$n.json" 2>"$LOGS/copies-$n.err"; then
    for i in $(seq 0 $((n - 1))); do
      INITS+=("$(field "$LOGS/copies-$n.json" "['copies'][$i]['init_pid']")")
      ask "$(field "$LOGS/copies-$n.json" "['copies'][$i]['ports'][0]['host_port']")" CHECK >/dev/null
    done
    echo "{\"copies\": $n, \"restore_to_all_answers_s\": $(elapsed "$t1"), \"restore\": $(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$LOGS/copies-$n.json")}" >>"$MULTI"
    for i in $(seq 0 $((n - 1))); do kill -9 "${INITS[-1-i]}" 2>/dev/null || true; done
  else
    echo "{\"copies\": $n, \"failed\": $(python3 -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()))' "$LOGS/copies-$n.err")}" >>"$MULTI"
  fi
done

python3 - "$GIB" "$RESULTS" "$MULTI" "$OUTDIR" <<'PY'
import json, statistics, sys
gib, results, multi, outdir = sys.argv[1:]
runs = [json.loads(l) for l in open(results)]
copies = [json.loads(l) for l in open(multi)]
def phase(doc, name):
    for p in doc.get("phases", []) or doc.get("checkpoint", {}).get("phases", []):
        if p["name"] == name:
            return p["seconds"]
    return None
rows = []
for r in runs:
    cp = r["run"].get("checkpoint", r["run"])
    # The source stopped: every phase but the wait for READY (the workload loading).
    capture = sum(p["seconds"] for p in cp.get("phases", []) if p["name"] != "wait-ready")
    tb = r["tier_bytes"]
    drain, fill = phase(cp, "pause"), phase(r["restore"], "resume")
    rows.append({"mode": r["mode"], "round": r["round"], "restore_s": r["restore_to_answer_s"],
                 "restore_command_s": r.get("restore_command_s"),
                 "capture_s": round(capture, 3), "gpu_checkpoint_s": phase(cp, "gpu-checkpoint"),
                 "gpu_restore_s": phase(r["restore"], "gpu-restore"),
                 "drain_gbs": round(tb / drain / 1e9, 1) if tb and drain else None,
                 # With a prefill the copy's resume only takes the memory over: no fill rate.
                 "fill_gbs": round(tb / fill / 1e9, 1) if tb and fill and r["mode"] != "tier" else None,
                 "disk_read_gbs": r["disk_read_gbs"], "ok": r["answer"].startswith("OK max_err=0 ")
                 and r["verify"].startswith("OK ")})
json.dump({"gib": float(gib), "runs": runs, "rows": rows, "copies": copies},
          open(f"{outdir}/tier-{gib}.json", "w"), indent=1)
with open(f"{outdir}/tier-{gib}.md", "w") as md:
    md.write(f"| path | round | restore to answer (s) | the command (s) | capture (s) | gpu-checkpoint | gpu-restore | drain GB/s | fill GB/s | disk GB/s | bit-exact |\n")
    md.write("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    for r in rows:
        md.write(f"| {r['mode']} | {r['round']} | {r['restore_s']} | {r['restore_command_s']} | {r['capture_s']} | {r['gpu_checkpoint_s']} | "
                 f"{r['gpu_restore_s']} | {r['drain_gbs']} | {r['fill_gbs']} | {r['disk_read_gbs']} | {r['ok']} |\n")
    for mode in ("transparent", "tier", "tier-no-prefill"):
        t = [r["restore_s"] for r in rows if r["mode"] == mode]
        if t:
            md.write(f"\n{mode}: median restore to answer {statistics.median(t)} s over {len(t)} runs\n")
    for c in copies:
        md.write(f"\n{c['copies']} copies at once: " +
                 (f"{c['restore_to_all_answers_s']} s to every copy's answer" if "failed" not in c else "failed: " + c["failed"]) + "\n")
print(open(f"{outdir}/tier-{gib}.md").read())
PY
python3 "$(dirname "$0")/tier_plot.py" "$OUTDIR/tier-$GIB.json" "$OUTDIR/tier-$GIB.svg"
