#!/usr/bin/env bash
# exp25 (issue 17): transformers LlamaForCausalLM of Llama-3-8B's shape (bf16, greedy generate())
# on main's build (16a1cb8), tier against the transparent path in one run: both captured by
# `gpusnap run`, then restores taking turns, each timed as the command and to the first correct
# answer (CHECK: generate() again, token for token the same). The machine's memory is touched once
# first (dd 48 GiB into the tmpfs, removed), as a first workload would have.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp25.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp25.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b21
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:330]) for n in d.get('notes',[]) if 'prefill' in n or 'driver' in n]" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
restore_once() {  # restore_once ART TAG
  local art=$1 tag=$2 port; port=$(cat $art.port)
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$tag-restore.json
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 1
}
W=$S/w; mkdir -p $W
dd if=/dev/zero of=$W/touch bs=16M count=3072 status=none; rm -f $W/touch
echo "== memory touched once t=$(( $(date +%s) - T0 ))s"
capture() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(sum(p['seconds'] for p in d['phases'] if p['name']!='wait-ready'),3))" "$1"; }
export GPUSNAP_TIER_LOG=1
for n in tier no-tier; do
  timeout 240 $B/gpusnap run -o $W/$n --json -- python3 $B/tests/llama_tier.py --$n \
    --ready-file $W/$n.port >$R/$n-run.json 2>$R/$n-run.err
  echo "== $n run rc=$? t=$(( $(date +%s) - T0 ))s, capture (source stopped) $(capture $R/$n-run.json) s"; phases $R/$n-run.json
  finish
done
for round in 1 2 3 4; do
  (( $(left) > 40 )) || { echo "NOT RUN (time): round $round"; break; }
  restore_once $W/tier tier-$round
  if (( round == 2 || round == 4 )); then restore_once $W/no-tier transparent-$round; fi
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
