#!/usr/bin/env bash
# exp42 (issue 17): pinned buffers sized for the host's caches. Each piece now moves through the
# pinned buffers a slice at a time, so the buffers may be smaller than the pieces; small enough,
# a slice is still in the CPU's cache when the copy engine reads it (fill) or when the CPU writes
# it to the file (drain), which saves passes through host memory. One build (b42); the buffer size
# by GPUSNAP_TIER_BUFFER_KIB (4096: main's size).
#  A. the prefill alone on one 16 GiB tier artifact, checksums on, 4096/1024/512/256/128 KiB;
#  B. restores of that artifact to the first correct answer, prefill buffers 4096/512/256 KiB;
#  C. drains (and the source's own fill after --leave-running) of four 8 GiB workloads started
#     by hand with 4096/1024/512/256 KiB buffers.
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp42.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp42.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=$PWD/.carry/b42
export GPUSNAP_TIER_LOG=1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
lscpu | grep -E "Model name|L2|L3|NUMA node\(s\)" 
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1" 2>&1 | cut -c1-900; }
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
gpu_busy_pids() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=110g gpusnap $S
dd if=/dev/zero of=$S/touch bs=16M count=3072 status=none; rm -f $S/touch
echo "touched 48 GiB t=$(( $(date +%s) - T0 ))s"
W=$S/w; mkdir -p $W

# C's four workloads start first, by hand, each with its buffer size; they load beside A's capture.
SIZES_C="4096 1024 512 256"
declare -A WPID
for kib in $SIZES_C; do
  mkdir -p -m 700 $W/ctl-$kib
  GPUSNAP_CONTROL_DIR=$W/ctl-$kib GPUSNAP_TIER_BUFFER_KIB=$kib GPUSNAP_TIER_LIBRARY=$B/libgpusnap-tier.so \
    setsid python3 $B/tests/torch_tier.py --tier --gib 8 --weights $W/wc-$kib.bin --ready-file $W/c-$kib.port \
    >$R/c-$kib.out 2>&1 < /dev/null &
  WPID[$kib]=$!
done

# A's artifact: 16 GiB, captured at READY by `gpusnap run` (main's defaults).
timeout 300 $B/gpusnap run -o $W/t16 --json -- \
  python3 $B/tests/torch_tier.py --tier --gib 16 --weights $W/weights.bin --ready-file $W/t16.port \
  >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 capture rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
grep -h "gpusnap-tier:" $R/t16-run.err | tail -2
T=$W/t16/tier
PID=$(ls $T/*.layout | head -1 | xargs basename | sed 's/.layout//')
CHUNK=$(python3 -c "import json;print(json.load(open('$W/t16/manifest.json'))['checksum']['chunk_bytes'])")
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "pid $PID chunk $CHUNK uuid $UUID files $(ls $T/*.img | wc -l) bytes $(du -sb $T | cut -f1)"
finish

# Nothing else loads while A and B measure.
for kib in $SIZES_C; do
  for _ in $(seq 600); do [[ -f $W/c-$kib.port ]] && break; sleep 0.2; done
  echo "c-$kib ready: $([[ -f $W/c-$kib.port ]] && echo yes || echo NO) pid ${WPID[$kib]} t=$(( $(date +%s) - T0 ))s"
done

prefill() {  # prefill TAG KIB CHUNK
  local sock=$W/p.sock; rm -f $sock
  GPUSNAP_TIER_PREFILL_STREAMS=16 GPUSNAP_TIER_BUFFER_KIB=$2 timeout 30 $B/gpusnap-tier-prefill $T $PID $sock "$UUID" 0 0 10000 -1 -1 $3 2>$R/prefill-$1.err &
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
  wait $pp; echo "== prefill $1 (buffer $2 KiB, chunk $3) rc=$?: $(grep -h 'gpusnap-tier-prefill' $R/prefill-$1.err | tail -1)"
}
echo "== A. the prefill alone"
for round in 1 2 3; do
  for kib in 4096 1024 512 256 128; do
    (( $(left) > 200 )) || { echo "NOT RUN (time)"; break 2; }
    prefill h$kib-$round $kib $CHUNK
  done
  finish
done
for round in 1 2; do
  for kib in 4096 512; do
    (( $(left) > 200 )) || { echo "NOT RUN (time)"; break 2; }
    prefill n$kib-$round $kib 0
  done
done
finish

echo "== B. restores to the first correct answer"
restore_host() {  # restore_host TAG KIB [verify]
  local port; port=$(cat $W/t16.port)
  local t1=$(date +%s.%N)
  GPUSNAP_TIER_BUFFER_KIB=$2 timeout 60 $B/gpusnap restore $W/t16 --publish $port --json > $R/rs-$1.json 2> $R/rs-$1.err
  local rc=$? t2=$(date +%s.%N)
  local hp; hp=$(grep -o '"host_port": *[0-9]*' $R/rs-$1.json | head -1 | grep -o '[0-9]*$')
  local ans; ans=$(timeout 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$hp; echo CHECK >&3; read -r r <&3; echo \$r")
  local t3=$(date +%s.%N)
  echo "== restore $1 (prefill buffer $2 KiB) rc=$rc command $(sec $t1 $t2) s, to first correct answer $(sec $t1 $t3) s: $ans"
  phases $R/rs-$1.json
  local dir; dir=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['copies'][0]['dir'])" $R/rs-$1.json 2>/dev/null)
  [[ -n $dir ]] && { cp $dir/restore.log $R/rs-$1-restore.log 2>/dev/null; grep -h "gpusnap-tier-prefill" $dir/*.log 2>/dev/null | tail -1; }
  grep -h "gpusnap-tier-prefill" $R/rs-$1.err | tail -1
  if [[ -n ${3:-} ]]; then
    echo "   VERIFY: $(timeout 120 bash -c "exec 3<>/dev/tcp/127.0.0.1/$hp; echo VERIFY >&3; read -r r <&3; echo \$r")"
  fi
  kill -9 $(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['copies'][0]['init_pid'])" $R/rs-$1.json) 2>/dev/null; sleep 0.7
}
for round in 1 2 3; do
  for kib in 4096 512 256; do
    (( $(left) > 130 )) || { echo "NOT RUN (time)"; break 2; }
    restore_host r$kib-$round $kib $([[ $round == 1 ]] && echo verify)
  done
  finish
done
rm -rf $W/t16 $W/weights.bin

echo "== C. drains of workloads started by hand"
ask() { timeout 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; echo $2 >&3; read -r r <&3; echo \$r"; }
for round in 1 2 3; do
  for kib in $SIZES_C; do
    (( $(left) > 25 )) || { echo "NOT RUN (time)"; break 2; }
    [[ -f $W/c-$kib.port ]] || continue
    local_t1=$(date +%s.%N)
    timeout 120 $B/gpusnap checkpoint -p ${WPID[$kib]} -o $W/cp-$kib-$round --leave-running --json >$R/cp-$kib-$round.json 2>$R/cp-$kib-$round.err
    rc=$?; local_t2=$(date +%s.%N)
    echo "== capture c-$kib round $round rc=$rc in $(sec $local_t1 $local_t2) s: $(ask $(cat $W/c-$kib.port) CHECK)"
    phases $R/cp-$kib-$round.json
    grep -h "gpusnap-tier:" $R/c-$kib.out | tail -2
    rm -rf $W/cp-$kib-$round
  done
  finish
done
for kib in $SIZES_C; do kill -9 ${WPID[$kib]} 2>/dev/null; done
sleep 2; rm -rf $W
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
