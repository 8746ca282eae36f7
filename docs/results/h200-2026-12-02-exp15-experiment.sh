#!/usr/bin/env bash
# exp15 (issue 17): what the verification beside the restore costs: b14 with and without --no-verify,
# alternating, on one 16 GiB tier artifact.
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp15.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp15.tgz r; }
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
  timeout 60 $B/gpusnap restore $art --publish $port --json $EXTRA >$R/$tag-restore.json 2>$R/$tag-restore.err
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
timeout $(( $(left) - 30 )) .carry/b14/gpusnap run -o $W/t16 --json -- python3 .carry/b14/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/t16.port >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
finish
declare -A seen
for round in 1 2 3 4 5 6 7; do
  if (( round % 2 )); then order="verify noverify"; else order="noverify verify"; fi
  for v in $order; do
    (( $(left) > 25 )) || { echo "NOT RUN (time): round $round $v"; break 2; }
    verify=""; [[ -z ${seen[$v]:-} ]] && verify=1; seen[$v]=1
    case $v in
      verify) EXTRA="" restore_once .carry/b14 $W/t16 $v-$round $verify;;
      noverify) EXTRA="--no-verify" restore_once .carry/b14 $W/t16 $v-$round $verify;;
    esac
  done
  finish
done
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
