#!/usr/bin/env bash
# exp27 (issue 17): exp27 found the tier copy's generate() slow in some restores (0.6-0.8 s for
# both the first and the second CHECK, against 0.39-0.49 s in others and 0.47 s transparent), the
# prefill already gone. Is it the copy killed just before, still being torn down by the driver?
# Here every restore first waits until no process holds the GPU (timed), and what holds the GPU
# when the first CHECK is asked is listed. Three CHECKs per restore; A/B as in exp27 dropped.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp27.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp27.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b21
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
watch_prefill() {  # prints seconds from now until no gpusnap-tier-prefill process is left
  local t=$(date +%s.%N)
  while pgrep -f gpusnap-tier-prefill >/dev/null; do sleep 0.005; done
  sec $t $(date +%s.%N)
}
restore_once() {  # restore_once ART TAG MODE(now|wait)
  local art=$1 tag=$2 mode=$3 port; port=$(cat $art.port)
  local tw=$(date +%s.%N)
  while [[ -n $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]]; do sleep 0.05; done
  echo "   the GPU free after $(sec $tw $(date +%s.%N)) s"
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  watch_prefill >$R/$tag.exit &
  local wp=$!
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  [[ $mode == wait ]] && wait $wp
  local apps; apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')
  local t3=$(date +%s.%N)
  local ans; ans=$(ask $hp CHECK); local t4=$(date +%s.%N)
  local ans2; ans2=$(ask $hp CHECK); local t5=$(date +%s.%N)
  local ans3; ans3=$(ask $hp CHECK); local t6=$(date +%s.%N)
  wait $wp 2>/dev/null
  echo "== $tag rc=$rc command $(sec $t1 $t2) s; prefill gone $(cat $R/$tag.exit) s after the command; first CHECK $(sec $t3 $t4) s (${ans:0:22}), second $(sec $t4 $t5) s, third $(sec $t5 $t6) s; holding the GPU at the first: $apps; to first answer $(sec $t1 $t4) s"
  phases $R/$tag-restore.json
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 1
}
W=$S/w; mkdir -p $W
dd if=/dev/zero of=$W/touch bs=16M count=3072 status=none; rm -f $W/touch
for n in tier no-tier; do
  timeout 240 $B/gpusnap run -o $W/$n --json -- python3 $B/tests/llama_tier.py --$n \
    --ready-file $W/$n.port >$R/$n-run.json 2>$R/$n-run.err
  echo "== $n run rc=$? t=$(( $(date +%s) - T0 ))s"; finish
done
for round in 1 2 3 4 5 6 7 8; do
  (( $(left) > 40 )) || { echo "NOT RUN (time): round $round"; break; }
  restore_once $W/tier tier-$round now
  (( round == 2 || round == 4 )) && restore_once $W/no-tier transparent-$round now
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
