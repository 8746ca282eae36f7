#!/usr/bin/env bash
# KV cache left out of the artifact, on one GPU machine, in one command.
# Run from the repository root there (the .carry tree carried):
#   bash .carry/kv/experiment.sh OUTDIR "0 8 64" CONTROL_GIB 2>&1 | tee OUTDIR/log
# For each size N in the list: `gpusnap run` starts examples/kv_cache_worker.py (copied to
# .carry/kv/) with an N GiB cache (0: one 2 MiB granule), which pauses (cache released),
# is captured into /dev/shm and stopped; then `gpusnap restore --publish` starts a copy, which
# re-maps its cache at the same addresses; CHECK through the published port must answer
# "OK max_err=0". CONTROL_GIB (optional) runs once more with --keep-kv-on-pause: the cache
# then goes into the artifact. If the first N > 0 fails, the sizes are run again with
# --free-address-on-pause (the worker's fallback). Raw outputs: OUTDIR/raw, packed at the end.
set -u
OUT=${1:?OUTDIR}; SIZES=${2:-"0 8"}; CONTROL=${3:-}
R=$OUT/raw
mkdir -p "$R"
ROOT=$PWD
G=$ROOT/.carry/build/gpusnap
W=$ROOT/.carry/kv/kv_cache_worker.py
export GPUSNAP_CRIU=$ROOT/.carry/criu/criu
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-230}  # no new case starts after this many seconds

now() { date +%s.%N; }
since() { python3 -c 'import sys, time; print(f"{time.time() - float(sys.argv[1]):.2f}")' "$1"; }
jget() { python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(eval("d" + sys.argv[2]))' "$1" "$2" 2>/dev/null; }
ask() {  # ask PORT CMD... : one connection, one line per command
  python3 - "$@" <<'PY'
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=120) as s:
    f = s.makefile("rw")
    for c in sys.argv[2:]:
        f.write(c + "\n"); f.flush()
        print(f"{c} -> {f.readline().strip()}", flush=True)
PY
}
gpumem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1; }

echo "== environment $(date -u +%FT%TZ)"
uname -r; nproc; free -g | sed -n 2p; df -h /dev/shm | tail -1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
python3 -c 'from cuda.bindings import driver; print("from cuda.bindings import driver: ok")' \
  || python3 -c 'from cuda import cuda; print("from cuda import cuda: ok (old layout)")' \
  || echo "NO cuda-python driver module"
python3 -m pip show cuda-bindings cuda-python 2>/dev/null | grep -E '^(Name|Version)'
"$GPUSNAP_CRIU" --version | head -2
sha256sum "$W" "$ROOT/.carry/kv/gpusnap_handshake.py" "$G"

one() {  # one NAME KV_GIB PORT [worker flags...]; returns 0 when CHECK said OK max_err=0
  local name=$1 kv=$2 port=$3; shift 3
  local art=/dev/shm/kvart-$name elapsed=$(( $(date +%s) - T0 ))
  if (( elapsed > BUDGET_S )); then echo "== $name: skipped (elapsed ${elapsed} s)"; return 2; fi
  rm -rf "$art"
  echo; echo "== $name: --kv-gib $kv $* (elapsed ${elapsed} s, GPU memory used $(gpumem))"
  local t; t=$(now)
  timeout 240 "$G" run -o "$art" --json -- python3 "$W" --kv-gib "$kv" --weights-gib 1 \
    --port "$port" "$@" ${WORKER_EXTRA:-} >"$R/$name-run.json" 2>"$R/$name-run.err"
  local rc=$?
  echo "gpusnap run: rc=$rc wall=$(since "$t") s"
  cat "$R/$name-run.json"; tail -n 20 "$R/$name-run.err"
  local launched; launched=$(ls -td /run/gpusnap/launched/*/ 2>/dev/null | head -1)
  [[ -n $launched ]] && cp "$launched/output.log" "$R/$name-source.log" 2>/dev/null
  echo "-- source log:"; cat "$R/$name-source.log" 2>/dev/null | cut -c1-600
  local spid; spid=$(grep -o '^ready port=[0-9]* pid=[0-9]*' "$R/$name-source.log" 2>/dev/null | sed 's/.*pid=//')
  if [[ $rc -ne 0 ]]; then
    [[ -n $spid ]] && kill -9 "$spid" 2>/dev/null && echo "killed the source $spid"
    rm -rf "$art"; return 1
  fi
  du -sb "$art" | tee "$R/$name-du.txt"
  ls -la "$art" > "$R/$name-ls.txt" 2>&1
  "$G" inspect "$art" --json >"$R/$name-inspect.json" 2>&1
  t=$(now)
  timeout 240 "$G" restore "$art" --publish "$port" --json >"$R/$name-restore.json" 2>"$R/$name-restore.err"
  rc=$?
  echo "gpusnap restore: rc=$rc wall=$(since "$t") s"
  cat "$R/$name-restore.json"; tail -n 20 "$R/$name-restore.err"
  local ok=1
  if [[ $rc -eq 0 ]]; then
    local init hp dir
    init=$(jget "$R/$name-restore.json" "['copies'][0]['init_pid']")
    hp=$(jget "$R/$name-restore.json" "['copies'][0]['ports'][0]['host_port']")
    dir=$(jget "$R/$name-restore.json" "['copies'][0]['dir']")
    ask "$hp" CHECK | tee "$R/$name-answers.txt"
    echo "restore command to first CHECK answer: $(since "$t") s" | tee -a "$R/$name-answers.txt"
    echo "GPU memory used with the copy running: $(gpumem)" | tee -a "$R/$name-answers.txt"
    ask "$hp" INFO PROBE CHECK | tee -a "$R/$name-answers.txt"
    head -1 "$R/$name-answers.txt" | grep -q '^CHECK -> OK max_err=0 ' && ok=0
    [[ -n $dir ]] && cp -r "$dir" "$R/$name-copy" 2>/dev/null
    [[ -n $init ]] && kill -9 "$init" && echo "killed the copy's init $init"
  else
    local cdir; cdir=$(ls -td /run/gpusnap/copies/*/ 2>/dev/null | head -1)
    [[ -n $cdir ]] && cp -r "$cdir" "$R/$name-copy" 2>/dev/null
  fi
  rm -rf "$art"
  return $ok
}

FLAGS=()
port=18100
first_big_failed=0
for n in $SIZES; do
  one "kv$n" "$n" $((port++)) "${FLAGS[@]}"
  rc=$?
  if [[ $rc -eq 1 && $n != 0 && $first_big_failed -eq 0 ]]; then
    first_big_failed=1
    echo; echo "== kv$n failed: running again with --free-address-on-pause"
    FLAGS=(--free-address-on-pause)
    one "kv0-free" 0 $((port++)) "${FLAGS[@]}"
    one "kv$n-free" "$n" $((port++)) "${FLAGS[@]}"
  fi
done
if [[ -n $CONTROL ]]; then
  one "kv$CONTROL-kept" "$CONTROL" $((port++)) --keep-kv-on-pause
fi
sleep 1
echo; echo "== after (elapsed $(( $(date +%s) - T0 )) s): GPU memory used $(gpumem)"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader

python3 - "$R" <<'PY' | tee "$OUT/h200-2026-11-30-kvcache-summary.json"
import glob, json, os, re, sys
R = sys.argv[1]
def load(p):
    try:
        return json.load(open(p))
    except Exception:
        return None
cases = {}
for run in sorted(glob.glob(f"{R}/*-run.json")):
    name = os.path.basename(run)[:-len("-run.json")]
    c = {"run": load(run)}
    du = f"{R}/{name}-du.txt"
    c["du_bytes"] = int(open(du).read().split()[0]) if os.path.exists(du) else None
    c["restore"] = load(f"{R}/{name}-restore.json")
    ans = f"{R}/{name}-answers.txt"
    c["answers"] = open(ans).read().splitlines() if os.path.exists(ans) else []
    if c["run"] and "bytes" in c["run"]:
        c["artifact_bytes"] = c["run"]["bytes"]
        c["capture_phases"] = {p["name"]: round(p["seconds"], 3) for p in c["run"]["phases"]}
    if c["restore"] and "phases" in c["restore"]:
        c["restore_phases"] = {p["name"]: round(p["seconds"], 3) for p in c["restore"]["phases"]}
    c["check_ok"] = bool(c["answers"]) and c["answers"][0].startswith("CHECK -> OK max_err=0 ")
    cases[name] = c
out = {"cases": {k: {x: v[x] for x in ("artifact_bytes", "du_bytes", "check_ok", "capture_phases",
                                        "restore_phases", "answers") if x in v}
                 for k, v in cases.items()}}
ratios = {}
for suffix in ("", "-free"):
    base = cases.get("kv0" + suffix, {})
    for name, c in cases.items():
        m = re.fullmatch(r"kv(\d+)" + re.escape(suffix), name)
        if not m or m.group(1) == "0" or not base.get("artifact_bytes") or not c.get("artifact_bytes"):
            continue
        r = {"json_bytes_ratio": c["artifact_bytes"] / base["artifact_bytes"],
             "du_bytes_ratio": c["du_bytes"] / base["du_bytes"] if c.get("du_bytes") and base.get("du_bytes") else None}
        r["at_most_1pct_larger"] = r["json_bytes_ratio"] <= 1.01 and (r["du_bytes_ratio"] or 0) <= 1.01
        ratios[f"{name} vs kv0{suffix}"] = r
for name, c in cases.items():
    if name.endswith("-kept") and cases.get("kv0", {}).get("artifact_bytes") and c.get("artifact_bytes"):
        ratios[f"{name} vs kv0 (control)"] = {"json_bytes_ratio": c["artifact_bytes"] / cases["kv0"]["artifact_bytes"],
                                              "extra_bytes": c["artifact_bytes"] - cases["kv0"]["artifact_bytes"]}
out["ratios"] = ratios
print(json.dumps(out, indent=1))
PY
tar czf "$OUT/h200-2026-11-30-kvcache-raw.tar.gz" -C "$R" . && rm -rf "$R"
echo "== done (elapsed $(( $(date +%s) - T0 )) s)"; ls -la "$OUT"
