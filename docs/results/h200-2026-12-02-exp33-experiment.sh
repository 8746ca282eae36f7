#!/usr/bin/env bash
# exp33 (issue 17): the tier's files hashed in the background from the end of the pause, while
# the driver's checkpoint and CRIU's dump run (the capture's checksum phase then reads CRIU's
# files alone), after exp32 found hashing inside the drain no faster. Side by side in one run:
# gpusnap of main before the change (.carry/old) and after (.carry/b32), the same library, client
# and workload (16 GiB tests/torch_tier.py with a CUDA graph), captures taking turns. Every
# artifact of the new build is verified in full and restored to the first correct answer. Then
# the tier's 4 and 16 GiB GPU tests on the new build.
OUT=$1; DEADLINE=${2:-570}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp33.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp33.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b32; OLD=.carry/old
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=100g gpusnap $S
# The machine's memory touched once first, as a first workload would have (exp23).
dd if=/dev/zero of=$S/touch bs=16M count=3072 status=none; rm -f $S/touch
echo "touched 48 GiB t=$(( $(date +%s) - T0 ))s"
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
gpu_idle() { for _ in $(seq 100); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && return; sleep 0.05; done; }
W=$S/w; mkdir -p $W
capture() {  # capture TAG GPUSNAP
  gpu_idle
  rm -rf /run/gpusnap/launched/*
  GPUSNAP_TIER_LOG=1 timeout 200 $2 run -o $W/$1 --json -- \
    python3 $B/tests/torch_tier.py --tier --gib 16 --weights $W/weights.bin --ready-file $W/$1.port \
    >$R/$1-run.json 2>$R/$1-run.err
  echo "== $1 capture ($2) rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/$1-run.json
  grep -h "gpusnap-tier: drained" /run/gpusnap/launched/*/output.log 2>/dev/null | tail -1
}
verify() {  # verify TAG
  local t1=$(date +%s.%N)
  timeout 120 $B/gpusnap verify $W/$1 >$R/$1-verify.out 2>&1
  local rc=$? t2=$(date +%s.%N)
  echo "== $1 verify rc=$rc in $(sec $t1 $t2) s: $(tail -1 $R/$1-verify.out)"
}
restore_once() {  # restore_once TAG GPUSNAP [verify]
  local art=$W/$1 port; port=$(cat $W/$1.port)
  gpu_idle
  local t1=$(date +%s.%N)
  timeout 60 $2 restore $art --publish $port --json >$R/$1-restore.json 2>$R/$1-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$1-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $1 restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$1-restore.json
  [[ -n ${3:-} ]] && echo "   VERIFY: $(ask $hp VERIFY)"
  kill -9 $(field $R/$1-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 0.5
}
for round in 1 2 3; do
  (( $(left) > 200 )) || { echo "NOT RUN (time): round $round"; break; }
  order="old new"; (( round % 2 == 0 )) && order="new old"
  for m in $order; do
    if [[ $m == old ]]; then capture old-$round $OLD/gpusnap; else capture new-$round $B/gpusnap; fi
  done
  verify new-$round
  restore_once new-$round $B/gpusnap "$( (( round == 1 )) && echo 1)"
  restore_once old-$round $OLD/gpusnap
  rm -rf $W/old-$round $W/new-$round
  finish
done
rm -rf $W
umount $S
cd $B/tests
echo "== gpu tests t=$(( $(date +%s) - T0 ))s"
timeout $(( $(left) - 10 )) ./gpusnap_gpu_tests --gtest_filter='MemoryTier.*GiBBitExactAfterRestoreAndTheGraphReplays' > $R/gpu-tests.log 2>&1
echo "== gpu tests rc=$?"; grep -E "^\[ +(OK|FAILED|PASSED|SKIPPED) " $R/gpu-tests.log
cd - >/dev/null
echo "done t=$(( $(date +%s) - T0 ))s"
