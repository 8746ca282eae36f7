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
