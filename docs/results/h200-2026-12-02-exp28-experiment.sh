#!/usr/bin/env bash
# exp28 (issue 17): bench/tier_bench.sh's 4 copies took 5.08 s (exp20: 3.10-3.27 s). The bench
# started them right after killing the 2 copies before: does the driver's teardown of killed
# copies slow the next restore? 4 copies of one 16 GiB tier artifact, restored (a) once no
# process holds the GPU, (b) right after the 4 copies before were killed, taking turns.
OUT=$1; DEADLINE=${2:-180}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp28.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp28.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b21
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
ask() { timeout 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
gpu_idle() { local t=$(date +%s.%N); for _ in $(seq 600); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && break; sleep 0.05; done; echo "   the GPU free after $(sec $t $(date +%s.%N)) s"; }
W=$S/w; mkdir -p $W
timeout 150 $B/gpusnap run -o $W/m --json -- python3 $B/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/m.port >$R/m-run.json 2>$R/m-run.err
echo "== run rc=$? t=$(( $(date +%s) - T0 ))s"; rm -f $W/weights.bin
KILL=()
copies4() {  # copies4 TAG
  local t1=$(date +%s.%N) answers=""
  timeout 60 $B/gpusnap restore $W/m --replicas 4 --publish $(cat $W/m.port) --json >$R/$1.json 2>$R/$1.err
  local rc=$?
  for i in 0 1 2 3; do answers+="$(ask $(field $R/$1.json "['copies'][$i]['ports'][0]['host_port']") CHECK | cut -c1-14); "; done
  echo "== $1 rc=$rc: 4 copies to every answer $(sec $t1 $(date +%s.%N)) s: $answers"
  python3 -c "import json,sys,re;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d['phases']]);print('   prefills:', [re.search(r'filled in [\d.]+ s|making and mapping the memory [\d.]+ s', n).group(0) + ' / ' + re.search(r'making and mapping the memory [\d.]+ s', n).group(0) for n in d['notes'] if 'prefill' in n])" $R/$1.json
  KILL=(); for i in 0 1 2 3; do KILL+=($(field $R/$1.json "['copies'][$i]['init_pid']")); done
}
for round in 1 2; do
  (( $(left) > 40 )) || break
  gpu_idle; copies4 idle-$round; kill -9 "${KILL[@]}"
  copies4 after-kill-$round; kill -9 "${KILL[@]}"
  finish
done
gpu_idle
rm -rf $W; finish; umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
