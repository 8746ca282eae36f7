#!/usr/bin/env bash
# exp16 (issue 17): the tier's files checked by the sums the prefill computes as it reads them
# (b16) against verify reading them beside CRIU's restore (b14), side by side on one 16 GiB tier
# artifact, rounds alternating; then a damaged tier file against b16; then the GPU tests of the
# tier without the one line and at 4 GiB.
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp16.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp16.tgz r; }
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
timeout $(( $(left) - 30 )) .carry/b16/gpusnap run -o $W/t16 --json -- python3 .carry/b16/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/t16.port >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
finish
declare -A seen
for round in 1 2 3 4 5 6; do
  if (( round % 2 )); then order="b16 b14"; else order="b14 b16"; fi
  for v in $order; do
    (( $(left) > 200 )) || { echo "NOT RUN (time): round $round $v"; break 2; }
    verify=""; [[ -z ${seen[$v]:-} ]] && verify=1; seen[$v]=1
    restore_once .carry/$v $W/t16 $v-$round $verify
  done
  finish
done
# One byte of one tier file changed: the prefill's sums must refuse the restore.
f=$(ls $W/t16/tier/*-w3.img | head -1)
python3 -c "import sys; f=open(sys.argv[1],'r+b'); f.seek(70<<20); b=f.read(1); f.seek(70<<20); f.write(bytes([b[0]^1]))" $f
timeout 60 .carry/b16/gpusnap restore $W/t16 --json >$R/damaged.json 2>$R/damaged.err
echo "== damaged restore rc=$? (4 expected): $(tail -c 600 $R/damaged.err)"
rm -rf $W; finish
cd .carry/b16/tests
echo "== gpu tests t=$(( $(date +%s) - T0 ))s"
timeout $(( $(left) - 10 )) ./gpusnap_gpu_tests --gtest_filter='MemoryTier.GpusnapRunInstallsTheTierWithoutTheOneLine:MemoryTier.FourGiBBitExactAfterRestoreAndTheGraphReplays' > $R/gpu-tests.log 2>&1
echo "== gpu tests rc=$?"; grep -E "^\[ +(OK|FAILED|RUN|PASSED|SKIPPED) " $R/gpu-tests.log
cd - >/dev/null
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
