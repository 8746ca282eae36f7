#!/usr/bin/env bash
# exp38 (issue 17): CRIU's restore with the copy's pages served lazily (`criu lazy-pages`, through
# userfaultfd) against CRIU's restore as main runs it, side by side in one run on one artifact:
# 16 GiB torch_tier.py (tier) and Llama-3-8B's shape (llama_tier.py, tier), restores taking turns,
# each to the first correct answer. The lazy restores go through a wrapper around the same CRIU
# (.carry/lazycriu/criu) that starts the daemon beside each `criu restore --lazy-pages`.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp38.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp38.tgz r; }
trap finish EXIT
CRIU_PLAIN=$PWD/.carry/criu/criu
export LAZY_REAL_CRIU=$CRIU_PLAIN
CRIU_LAZY=$PWD/.carry/lazycriu/criu
export GPUSNAP_CRIU=$CRIU_PLAIN
B=.carry/b39
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:330]) for n in d.get('notes',[]) if 'prefill' in n]" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=100g gpusnap $S
dd if=/dev/zero of=$S/touch bs=16M count=3072 status=none; rm -f $S/touch
echo "touched 48 GiB t=$(( $(date +%s) - T0 ))s"
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
gpu_idle() { for _ in $(seq 100); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && return; sleep 0.05; done; }
restore_once() {  # restore_once ART TAG CRIU [verify]
  local art=$1 tag=$2 criu=$3 port; port=$(cat $art.port)
  gpu_idle
  local t1=$(date +%s.%N)
  GPUSNAP_CRIU=$criu timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$tag-restore.json
  local d; d=$(field $R/$tag-restore.json "['copies'][0]['dir']")
  if [[ -f $d/lazy.log ]]; then
    echo "   lazy daemon: $(grep -c 'uffd_copy' $d/lazy.log) copies, last line: $(tail -1 $d/lazy.log | cut -c1-120)"
    echo "   restore.log last: $(tail -1 $d/restore.log | cut -c1-100)"
    cp $d/lazy.log $R/$tag-lazy.log 2>/dev/null; gzip -f $R/$tag-lazy.log
  fi
  cp $d/restore.log $R/$tag-criu-restore.log 2>/dev/null; gzip -f $R/$tag-criu-restore.log
  [[ -n ${4:-} ]] && echo "   VERIFY: $(ask $hp VERIFY)"
  echo "   CHECK again: $(ask $hp CHECK)"
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 0.5
}
W=$S/w; mkdir -p $W
export GPUSNAP_TIER_LOG=1
gpu_idle
timeout 200 $B/gpusnap run -o $W/t16 --json -- \
  python3 $B/tests/torch_tier.py --tier --gib 16 --weights $W/weights.bin --ready-file $W/t16.port \
  >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 capture rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
for round in 1 2 3 4 5 6; do
  order="plain lazy"; (( round % 2 == 0 )) && order="lazy plain"
  for m in $order; do
    (( $(left) > 200 )) || { echo "NOT RUN (time): t16 round $round $m"; break 2; }
    c=$CRIU_PLAIN; [[ $m == lazy ]] && c=$CRIU_LAZY
    verify=""; (( round <= 1 )) && verify=1
    restore_once $W/t16 t16-$m-$round $c $verify
  done
  finish
done
rm -rf $W/t16 $W/weights.bin
(( $(left) > 150 )) || { echo "NOT RUN (time): llama"; exit 0; }
gpu_idle
timeout 150 $B/gpusnap run -o $W/llama --json -- python3 $B/tests/llama_tier.py --tier \
  --ready-file $W/llama.port >$R/llama-run.json 2>$R/llama-run.err
echo "== llama capture rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/llama-run.json
for round in 1 2 3 4; do
  order="plain lazy"; (( round % 2 == 0 )) && order="lazy plain"
  for m in $order; do
    (( $(left) > 20 )) || { echo "NOT RUN (time): llama round $round $m"; break 2; }
    c=$CRIU_PLAIN; [[ $m == lazy ]] && c=$CRIU_LAZY
    restore_once $W/llama llama-$m-$round $c
  done
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
