#!/usr/bin/env bash
# exp26 (issue 17): why the first generate() after a tier restore of the Llama-3-8B-shaped
# workload took 0.47-0.78 s against 0.46 s after a transparent restore (exp25). Does the
# prefill's exit (its CUDA context torn down, 16 GB unmapped and released) slow the copy's first
# work? Restores taking turns: A asks CHECK at once (as a user would), B waits for the prefill
# process to be gone first; each CHECK is timed on its own, then a second CHECK as the steady
# reference. The prefill's exit is timed from the command's end in both.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp26.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp26.tgz r; }
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
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  watch_prefill >$R/$tag.exit &
  local wp=$!
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  [[ $mode == wait ]] && wait $wp
  local t3=$(date +%s.%N)
  local ans; ans=$(ask $hp CHECK); local t4=$(date +%s.%N)
  local ans2; ans2=$(ask $hp CHECK); local t5=$(date +%s.%N)
  wait $wp 2>/dev/null
  echo "== $tag rc=$rc command $(sec $t1 $t2) s; prefill gone $(cat $R/$tag.exit) s after the command; first CHECK $(sec $t3 $t4) s (${ans:0:22}), second $(sec $t4 $t5) s; to first answer $(sec $t1 $t4) s"
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
for round in 1 2 3 4 5; do
  (( $(left) > 40 )) || { echo "NOT RUN (time): round $round"; break; }
  if (( round % 2 )); then order="now wait"; else order="wait now"; fi
  for m in $order; do restore_once $W/tier tier-$m-$round $m; done
  (( round == 3 )) && restore_once $W/no-tier transparent-$round now
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
