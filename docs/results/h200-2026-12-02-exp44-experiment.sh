#!/usr/bin/env bash
# exp44: XXH3 built for the CPU's widest vectors (ddf08ac) against libxxhash.a's SSE2 build
# (.carry/b44/old: main at d644027), on the H200 machine: `gpusnap verify` of a 16 GiB tier
# artifact and the prefill alone with its checksums, taking turns; restores of that artifact
# with the new build; then the bench on main (BENCH_RUNS=1) with what time is left.
OUT=$1; DEADLINE=${2:-570}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp44.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp44.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=$PWD/.carry/b44
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
grep -o -w -m1 -E "avx512f|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
(cat /proc/cmdline; dmesg 2>/dev/null | grep -i "mem auto-init") | head -3
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1" 2>&1 | cut -c1-900; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=100g gpusnap $S
dd if=/dev/zero of=$S/touch bs=16M count=3072 status=none; rm -f $S/touch
echo "touched 48 GiB t=$(( $(date +%s) - T0 ))s"
W=$S/w; mkdir -p $W
timeout 200 $B/gpusnap run -o $W/t16 --json -- \
  python3 $B/tests/torch_tier.py --tier --gib 16 --weights $W/weights.bin --ready-file $W/t16.port \
  >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 capture rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
T=$W/t16/tier
PID=$(ls $T/*.layout | head -1 | xargs basename | sed 's/.layout//')
CHUNK=$(python3 -c "import json;print(json.load(open('$W/t16/manifest.json'))['checksum']['chunk_bytes'])")
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "pid $PID chunk $CHUNK artifact bytes $(du -sb $W/t16 | cut -f1)"
finish

echo "== verify, taking turns"
for round in 1 2; do
  for who in old new; do
    bin=$B/gpusnap; [[ $who == old ]] && bin=$B/old/gpusnap
    t1=$(date +%s.%N); timeout 60 $bin verify $W/t16 --json >$R/verify-$who-$round.json 2>$R/verify-$who-$round.err; rc=$?; t2=$(date +%s.%N)
    echo "verify $who-$round rc=$rc $(sec $t1 $t2) s"; phases $R/verify-$who-$round.json
  done
done
finish

prefill() {  # prefill TAG BINARY
  local sock=$W/p.sock; rm -f $sock
  timeout 30 $2 $T $PID $sock "$UUID" 0 0 10000 -1 -1 $CHUNK 2>$R/prefill-$1.err &
  local pp=$!
  python3 - "$sock" <<'PY'
import socket, sys, time, os
path = sys.argv[1]
for _ in range(2000):
    if os.path.exists(path): break
    time.sleep(0.005)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
s.recv(65536)
s.sendall(b"n")
time.sleep(0.2)
PY
  wait $pp; echo "== prefill $1 rc=$?: $(grep -h 'gpusnap-tier-prefill' $R/prefill-$1.err | tail -1)"
}
echo "== the prefill alone, checksums on, taking turns"
for round in 1 2 3; do
  prefill old-$round $B/old/gpusnap-tier-prefill
  prefill new-$round $B/gpusnap-tier-prefill
done
finish

echo "== restores with the new build"
restore_host() {  # restore_host TAG [verify]
  local port; port=$(cat $W/t16.port)
  local t1=$(date +%s.%N)
  timeout 60 $B/gpusnap restore $W/t16 --publish $port --json > $R/rs-$1.json 2> $R/rs-$1.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/rs-$1.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(timeout 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$hp; echo CHECK >&3; read -r r <&3; echo \$r")
  local t3=$(date +%s.%N)
  echo "== restore $1 rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/rs-$1.json
  if [[ -n ${2:-} ]]; then
    echo "   VERIFY: $(timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$hp; echo VERIFY >&3; read -r r <&3; echo \$r")"
  fi
  kill -9 $(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['copies'][0]['init_pid'])" $R/rs-$1.json) 2>/dev/null; sleep 0.7
}
for n in 1 2 3; do
  (( $(left) > 330 )) || { echo "NOT RUN (time)"; break; }
  restore_host r$n $([[ $n == 1 ]] && echo verify)
done
finish
rm -rf $W; umount $S

echo "== the bench on main, BENCH_RUNS=1, t=$(( $(date +%s) - T0 ))s, $(left) s left"
if (( $(left) > 300 )); then
  BENCH_RUNS=1 BUILD=$B timeout $(( $(left) - 10 )) bench/tier_bench.sh 16 $R/bench > $R/bench.log 2>&1
  echo "bench rc=$?"; tail -5 $R/bench.log; cat $R/bench/tier-16.md 2>/dev/null
else
  echo "NOT RUN (time)"
fi
echo "done t=$(( $(date +%s) - T0 ))s"
