#!/usr/bin/env bash
# exp22 (issue 17): each copy's prefills checksum a share of the tier's files (copy c of N: the
# files whose index is c modulo N; build b22) against only the first copy's prefills
# checksumming them all (b21: main at 16a1cb8), side by side in one run: 2 and 4 copies of the
# 16 GiB tier artifact restored at once onto one GPU, to every copy's correct answer, taking
# turns over two rounds; three single tier restores with b22 first.
OUT=$1; DEADLINE=${2:-560}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp22.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp22.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b22; OLD=.carry/b21
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])]); [print('note:',n[:400]) for n in d.get('notes',[]) if 'prefill' in n]" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
ask() { timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }
restore_once() {  # restore_once ART PORTFILE TAG [verify]
  local art=$1 port; port=$(cat $2); local tag=$3
  local t1=$(date +%s.%N)
  timeout 90 $B/gpusnap restore $art --publish $port --json >$R/$tag-restore.json 2>$R/$tag-restore.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/$tag-restore.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(ask $hp CHECK); local t3=$(date +%s.%N)
  echo "== $tag restore rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/$tag-restore.json
  [[ -n ${4:-} ]] && echo "   VERIFY: $(ask $hp VERIFY)"
  kill -9 $(field $R/$tag-restore.json "['copies'][0]['init_pid']") 2>/dev/null; sleep 1
}
copies_once() {  # copies_once N TAG: N copies of the tier artifact at once, to every correct answer
  local n=$1 tag=$2 port; port=$(cat $W/t16.port)
  local t1=$(date +%s.%N)
  timeout 120 $B/gpusnap restore $W/t16 --replicas $n --publish $port --json >$R/$tag.json 2>$R/$tag.err
  local rc=$? t2=$(date +%s.%N) answers=""
  for i in $(seq 0 $((n - 1))); do
    answers+="$(ask $(field $R/$tag.json "['copies'][$i]['ports'][0]['host_port']") CHECK | cut -c1-24); "
  done
  local t3=$(date +%s.%N)
  echo "== $tag ($n copies) rc=$rc command $(sec $t1 $t2) s, to every copy's correct answer $(sec $t1 $t3) s: $answers"
  phases $R/$tag.json
  for i in $(seq 0 $((n - 1))); do kill -9 $(field $R/$tag.json "['copies'][$i]['init_pid']") 2>/dev/null; done
  sleep 2
}
W=$S/w; mkdir -p $W
export GPUSNAP_TIER_LOG=1
timeout 200 $B/gpusnap run -o $W/warm --json -- python3 $B/tests/torch_tier.py --no-tier --gib 16 \
  --weights $W/weights.bin >$R/warm-run.json 2>$R/warm-run.err
echo "== warm run rc=$? t=$(( $(date +%s) - T0 ))s"; rm -rf $W/warm
timeout 200 $B/gpusnap run -o $W/t16 --json -- python3 $B/tests/torch_tier.py --tier --gib 16 \
  --weights $W/weights.bin --ready-file $W/t16.port >$R/t16-run.json 2>$R/t16-run.err
rc=$?; echo "== t16 run rc=$rc t=$(( $(date +%s) - T0 ))s"; [[ $rc == 0 ]] || { tail -3 $R/t16-run.err; exit 1; }; phases $R/t16-run.json
capture() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(sum(p['seconds'] for p in d['phases'] if p['name']!='wait-ready'),3))" "$1"; }
echo "== capture (source stopped): tier $(capture $R/t16-run.json) s"
finish
restore_once $W/t16 $W/t16.port tier-1 verify
restore_once $W/t16 $W/t16.port tier-2
restore_once $W/t16 $W/t16.port tier-3
# Copies at once: b22 against b21 (main), taking turns.
for round in 1 2; do
  for n in 2 4; do
    (( $(left) > 40 )) || { echo "NOT RUN (time): copies round $round n=$n"; continue; }
    if (( round == 1 )); then
      copies_once $n spread-$n-r$round
      B=$OLD copies_once $n first-$n-r$round
    else
      B=$OLD copies_once $n first-$n-r$round
      copies_once $n spread-$n-r$round
    fi
    finish
  done
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
