#!/usr/bin/env bash
# exp30 (issue 17): the tier's drain sets the GPU threads' stack to 0 (the driver frees the local
# memory behind it, 264 MiB on the H200) and the fill puts it back. Side by side in one run: a 16
# GiB tier artifact captured with GPUSNAP_TIER_STACK=keep (as before) and one with the default,
# then restores of each taking turns, to the first correct answer (the graph replayed).
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp30.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp30.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b29
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:330]) for n in d.get('notes',[]) if 'prefill' in n or 'driver' in n]" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=100g gpusnap $S
# The machine's memory touched once first, as a first workload would have (exp23).
dd if=/dev/zero of=$S/touch bs=16M count=3072 status=none; rm -f $S/touch
echo "touched 48 GiB t=$(( $(date +%s) - T0 ))s"
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
gpu_idle() { for _ in $(seq 100); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && return; sleep 0.05; done; }
restore_once() {  # restore_once ART TAG [verify]
  local art=$1 tag=$2 port; port=$(cat $art.port)
  gpu_idle
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$tag-restore.json
  [[ -n ${3:-} ]] && echo "   VERIFY: $(ask $hp VERIFY)"
  echo "   CHECK again: $(ask $hp CHECK)"
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 0.5
}
W=$S/w; mkdir -p $W
capture() {  # capture TAG STACKSETTING
  gpu_idle
  GPUSNAP_TIER_STACK=$2 GPUSNAP_TIER_LOG=1 timeout 200 $B/gpusnap run -o $W/$1 --json -- \
    python3 $B/tests/torch_tier.py --tier --gib 16 --weights $W/weights.bin --ready-file $W/$1.port \
    >$R/$1-run.json 2>$R/$1-run.err
  echo "== $1 capture (GPUSNAP_TIER_STACK=$2) rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/$1-run.json
  grep -h "gpusnap-tier" /run/gpusnap/launched/*/output.log 2>/dev/null | tail -2
  du -sb $W/$1 | cut -f1 | sed 's/^/   artifact bytes: /'
}
capture keep keep
capture free free
for round in 1 2 3 4 5 6; do
  order="keep free"; (( round % 2 == 0 )) && order="free keep"
  for m in $order; do
    (( $(left) > 25 )) || { echo "NOT RUN (time): round $round $m"; break 2; }
    verify=""; (( round <= 2 )) && verify=1
    restore_once $W/$m $m-$round $verify
  done
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
