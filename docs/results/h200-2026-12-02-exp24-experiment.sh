#!/usr/bin/env bash
# exp24 (issue 17): does THP `always` on the host shorten the tier restore's critical path
# (CRIU's restore of the process's pages into fresh 4 KiB pages, the driver's restore)? One 16 GiB
# tier artifact, restores to the first correct answer with the host's THP mode switched between
# `madvise` (as found) and `always` in turns; the mode is put back at the end.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp24.log" 2>&1
THP=/sys/kernel/mm/transparent_hugepage/enabled
ORIG=$(grep -o '\[[a-z]*\]' $THP | tr -d '[]')
finish() { echo $ORIG >$THP; tar -C $OUT -czf $OUT/exp24.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b21
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
echo "THP enabled: $(cat $THP); defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:330]) for n in d.get('notes',[]) if 'prefill' in n]" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
thp() { grep -E "^(thp_fault_alloc|thp_fault_fallback|pgfault) " /proc/vmstat | awk '{printf "%s=%s ", $1, $2}'; }
restore_once() {  # restore_once ART TAG [verify]
  local art=$1 tag=$2 port; port=$(cat $art.port)
  local v0; v0=$(thp)
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$tag-restore.json
  echo "   vmstat before: $v0"; echo "   vmstat after:  $(thp)"
  [[ -n ${3:-} ]] && echo "   VERIFY: $(ask $hp VERIFY)"
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 1
}
W=$S/w; mkdir -p $W
timeout 200 $B/gpusnap run -o $W/t16 --json -- python3 $B/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/t16.port >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 run rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
rm -f $W/weights.bin
declare -A seen
for round in 1 2 3 4 5 6 7 8; do
  order="madvise always"; (( round % 2 == 0 )) && order="always madvise"
  for m in $order; do
    (( $(left) > 25 )) || { echo "NOT RUN (time): round $round $m"; break 2; }
    echo $m >$THP
    verify=""; [[ -z ${seen[$m]:-} ]] && verify=1; seen[$m]=1
    restore_once $W/t16 $m-$round $verify
  done
  tar -C $OUT -czf $OUT/exp24.tgz r
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
