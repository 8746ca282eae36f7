#!/usr/bin/env bash
# exp18 (issue 17): main's build (2432da7: the prefill's sums, 16 workers by default) as a user
# runs it: the weights made by a first run (as bench/tier_bench.sh does), then the 16 GiB tier
# capture and the same workload's transparent capture, then ten tier restores and two
# transparent ones taking turns, each to the first correct answer.
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp18.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp18.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:300]) for n in d.get('notes',[]) if 'prefill' in n]" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=60g gpusnap $S
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
restore_once() {  # restore_once BUILD ART TAG [verify]
  local B=$1 art=$2 tag=$3 port; port=$(cat $art.port)
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$tag-restore.json
  [[ -n ${4:-} ]] && echo "   VERIFY: $(ask $hp VERIFY)"
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 1
}
W=$S/w; mkdir -p $W
export GPUSNAP_TIER_LOG=1
timeout 200 .carry/b18/gpusnap run -o $W/warm --json -- python3 .carry/b18/tests/torch_tier.py --no-tier --gib 16 \
  --weights $W/weights.bin >$R/warm-run.json 2>$R/warm-run.err
echo "== warm run rc=$? t=$(( $(date +%s) - T0 ))s"; rm -rf $W/warm
timeout $(( $(left) - 30 )) .carry/b18/gpusnap run -o $W/t16 --json -- python3 .carry/b18/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/t16.port >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
finish
# The transparent path: the same workload without the tier, captured in the same run.
timeout 200 .carry/b18/gpusnap run -o $W/n16 --json -- python3 .carry/b18/tests/torch_tier.py --no-tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/n16.port >$R/n16-run.json 2>$R/n16-run.err
echo "== n16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/n16-run.json
capture() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(sum(p['seconds'] for p in d['phases'] if p['name']!='wait-ready'),3))" "$1"; }
echo "== capture (source stopped): tier $(capture $R/t16-run.json) s, transparent $(capture $R/n16-run.json) s"
for round in 1 2 3 4 5 6 7 8 9 10; do
  (( $(left) > 30 )) || { echo "NOT RUN (time): round $round"; break; }
  verify=""; (( round == 1 )) && verify=1
  restore_once .carry/b18 $W/t16 tier-$round $verify
  if (( round == 3 || round == 7 )); then restore_once .carry/b18 $W/n16 transparent-$round; fi
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
