#!/usr/bin/env bash
# exp13 (issue 17): the build to be merged (prefill with 8 workers, CRIU's kernel cache, the
# prefill's exit off the path): bench/tier_bench.sh 16 with three rounds, then Llama-3-8B's shape
# on the tier and on the transparent path if time is left.
OUT=$1; DEADLINE=${2:-520}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp13.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp13.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=$PWD/.carry/b13
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:260]) for n in d.get('notes',[])]" "$1"; }
BENCH_RUNS=3 BENCH_COPIES="" BUILD=$B timeout $(( $(left) - 15 )) bash bench/tier_bench.sh 16 $R/bench; echo "bench rc=$? t=$(( $(date +%s) - T0 ))s"
for f in $R/bench/tier-16-logs/*restore.json; do echo "--- $f"; phases "$f" 2>&1 | head -4; done
finish
(( $(left) > 75 )) || { echo "NOT RUN (time): llama"; exit 0; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=60g gpusnap $S
ask() { timeout 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
restore_once() {
  local n=$1 art=$2 tag=$3 port; port=$(cat $art.port)
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$n-$tag-restore.json 2>$R/$n-$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$n-$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  local t4=$(date +%s.%N); ask $hp CHECK >/dev/null; local t5=$(date +%s.%N)
  echo "== $n $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s (a second CHECK alone $(sec $t4 $t5) s): $ans"
  phases $R/$n-$tag-restore.json
  kill -9 $(field $R/$n-$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 1
}
W=$S/llama; mkdir -p $W
for mode in tier no-tier; do
  n=llama-$mode
  timeout $(( $(left) - 20 )) $B/gpusnap run -o $W/$n --json -- python3 $B/tests/llama_tier.py --$mode \
    --ready-file $W/$n.port >$R/$n-run.json 2>$R/$n-run.err
  echo "== $n run rc=$?"; phases $R/$n-run.json
  if [[ $mode == tier ]]; then
    restore_once $n $W/$n prefill
    GPUSNAP_TIER_PREFILL=off restore_once $n $W/$n noprefill
  else
    restore_once $n $W/$n transparent
  fi
  rm -rf $W/$n; finish
done
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
