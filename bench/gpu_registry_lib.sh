# shellcheck shell=bash
# Parts shared by the GPU scenarios that restore from a local registry (gpu_tier_registry.sh,
# gpu_llama_fresh_node.sh). Sourced after the caller sets W (its work folder), REGDIR (the
# registry's storage), REGPID (the registry, once started) and INITS (the copies' init pids);
# cleanup removes W and REGDIR and ends the copies and the registry on the caller's exit.
REGPID=""; INITS=()
cleanup() {
  local p
  for p in "${INITS[@]}"; do kill -9 "$p" 2>/dev/null; done
  [[ -n $REGPID ]] && kill "$REGPID" 2>/dev/null
  rm -rf "$W" "$REGDIR"
}
trap cleanup EXIT
now() { date +%s.%N; }
# Seconds since the time $1 (from now), to the millisecond.
el() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$(now)"; }
# The value at the Python subscript $2 (e.g. "['copies'][0]['init_pid']") of the JSON file $1.
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2" 2>/dev/null; }
phases() {  # the phases of a command's JSON, one line
  python3 - "$1" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"(no JSON: {e})"); sys.exit()
ph = d.get("phases") or d.get("checkpoint", {}).get("phases") or []
print(" ".join(f"{p['name']}={p['seconds']:.3f}" for p in ph))
PY
}
# The first copy's published host port in a restore's JSON.
host_port() { grep -o '"host_port": *[0-9]*' "$1" | head -1 | grep -o '[0-9]*$'; }
# One request line to 127.0.0.1:$1, its answer line (a workload's line protocol); 120 s at most.
# shellcheck disable=SC2016  # $1 and $2 are the inner shell's arguments
ask() { timeout 120 bash -c 'exec 3<>/dev/tcp/127.0.0.1/$1; printf "%s\n" "$2" >&3; IFS= read -r r <&3; printf "%s" "$r"' _ "$1" "$2"; }
# Waits (30 s at most) until no process uses the GPU: a copy killed before still releases it.
gpu_idle() {
  for _ in $(seq 600); do
    [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) ]] && return
    sleep 0.05
  done
}
# CPU seconds, in hundredths, used so far by this shell's finished children ($CPU_SELF) and by the
# registry ($CPU_REG): `cpu_mark` before a command and `cpu_since` after it say where a pull's
# CPU went, gpusnap's side or the registry's, when both share the machine's cores. In the current
# shell (no subshell: a fork's counters start from zero).
cpu_read() {
  local line u s f=${TMPDIR:-/tmp}/gpusnap-bench-times.$$
  times >"$f"  # the builtin here, not in a pipe's subshell
  line=$(tail -1 "$f"); rm -f "$f"
  [[ $line =~ ^([0-9]+)m([0-9]+)\.([0-9]+)s\ ([0-9]+)m([0-9]+)\.([0-9]+)s ]] || return
  u=$(( BASH_REMATCH[1] * 6000 + 10#${BASH_REMATCH[2]} * 100 + 10#${BASH_REMATCH[3]:0:2} ))
  s=$(( BASH_REMATCH[4] * 6000 + 10#${BASH_REMATCH[5]} * 100 + 10#${BASH_REMATCH[6]:0:2} ))
  CPU_SELF=$(( u + s ))
  CPU_REG=0
  if [[ -n $REGPID && -r /proc/$REGPID/stat ]]; then
    local stat; stat=$(</proc/"$REGPID"/stat)
    local -a fields; read -ra fields <<<"${stat##*) }"
    # utime and stime, fields 14 and 15 of stat (11 and 12 after the command's name), in ticks.
    CPU_REG=$(( (fields[11] + fields[12]) * 100 / $(getconf CLK_TCK) ))
  fi
}
cpu_mark() { cpu_read; CPU_SELF0=$CPU_SELF; CPU_REG0=$CPU_REG; }
# CPU_TEXT="cpu: gpusnap S s, registry R s", since cpu_mark.
cpu_since() {
  cpu_read
  # shellcheck disable=SC2034  # read by the caller
  CPU_TEXT=$(printf 'cpu: gpusnap %d.%02d s, registry %d.%02d s' $(( (CPU_SELF - CPU_SELF0) / 100 )) \
    $(( (CPU_SELF - CPU_SELF0) % 100 )) $(( (CPU_REG - CPU_REG0) / 100 )) $(( (CPU_REG - CPU_REG0) % 100 )))
}
