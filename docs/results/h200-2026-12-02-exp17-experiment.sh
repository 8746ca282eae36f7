#!/usr/bin/env bash
# exp17 (issue 17): the prefill checksumming each 1 MiB slice as it reads it (b17) with 8 and 16
# workers, against b14 (verify reading the tier's files beside CRIU), rounds alternating on one
# 16 GiB tier artifact; the transparent path on the same workload in the same run; then
# Llama-3-8B's shape on b17 if time is left.
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp17.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp17.tgz r; }
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
timeout $(( $(left) - 30 )) .carry/b17/gpusnap run -o $W/t16 --json -- python3 .carry/b17/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/t16.port >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
finish
# The transparent path: the same workload without the tier, captured in the same run.
timeout 200 .carry/b17/gpusnap run -o $W/n16 --json -- python3 .carry/b17/tests/torch_tier.py --no-tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/n16.port >$R/n16-run.json 2>$R/n16-run.err
echo "== n16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/n16-run.json
declare -A seen
for round in 1 2 3 4 5; do
  case $((round % 3)) in
    0) order="b14 b17 b17w16";; 1) order="b17 b17w16 b14";; 2) order="b17w16 b14 b17";;
  esac
  for v in $order; do
    (( $(left) > 150 )) || { echo "NOT RUN (time): round $round $v"; break 2; }
    verify=""; [[ -z ${seen[$v]:-} ]] && verify=1; seen[$v]=1
    case $v in
      b14) restore_once .carry/b14 $W/t16 $v-$round $verify;;
      b17) restore_once .carry/b17 $W/t16 $v-$round $verify;;
      b17w16) GPUSNAP_TIER_PREFILL_STREAMS=16 restore_once .carry/b17 $W/t16 $v-$round $verify;;
    esac
  done
  if (( round <= 2 )); then restore_once .carry/b17 $W/n16 transparent-$round; fi
  finish
done
rm -rf $W/t16 $W/n16 $W/weights.bin; finish
(( $(left) > 150 )) || { echo "NOT RUN (time): llama"; umount $S; exit 0; }
n=llama; timeout $(( $(left) - 40 )) .carry/b17/gpusnap run -o $W/$n --json -- python3 .carry/b17/tests/llama_tier.py --tier \
  --ready-file $W/$n.port >$R/$n-run.json 2>$R/$n-run.err
echo "== $n run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/$n-run.json
for k in 1 2; do (( $(left) > 15 )) && restore_once .carry/b17 $W/$n llama-$k; done
finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
