#!/usr/bin/env bash
# exp39 (issue 17): what bounds the prefill's fill (25-30 GB/s beside a restore in exp38)? The
# prefill run alone on a 16 GiB tier artifact, nothing else on the machine: with and without its
# checksums, with 8-32 workers, and the page cache's own read speed of the same files (dd).
OUT=$1; DEADLINE=${2:-300}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp39.log" 2>&1
finish() { tar -C $OUT -czf $OUT/exp39.tgz r; }
trap finish EXIT
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b39
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
phases() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print([(p['name'],round(p['seconds'],3)) for p in d.get('phases',[])])" "$1"; }
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=100g gpusnap $S
dd if=/dev/zero of=$S/touch bs=16M count=3072 status=none; rm -f $S/touch
echo "touched 48 GiB t=$(( $(date +%s) - T0 ))s"
W=$S/w; mkdir -p $W
timeout 200 $B/gpusnap run -o $W/t16 --json -- \
  python3 $B/tests/torch_tier.py --tier --gib 16 --weights $W/weights.bin --ready-file $W/t16.port \
  >$R/t16-run.json 2>$R/t16-run.err
echo "== t16 capture rc=$? t=$(( $(date +%s) - T0 ))s"; phases $R/t16-run.json
pkill -f torch_tier.py; sleep 1
T=$W/t16/tier; ls -la $T | head -30
PID=$(ls $T/*.layout | head -1 | xargs basename | sed 's/.layout//')
CHUNK=$(python3 -c "import json;print(json.load(open('$W/t16/manifest.json'))['checksum']['chunk_bytes'])")
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "pid $PID chunk $CHUNK uuid $UUID"
sec() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 3))" "$1" "$2"; }
readall() {
  local t1=$(date +%s.%N)
  for f in $T/$PID-w*.img; do dd if=$f of=/dev/null bs=1M status=none & done; wait
  local t2=$(date +%s.%N)
  echo "== dd of every tier file at once ($(ls $T/$PID-w*.img | wc -l) readers, $(du -sb $T | cut -f1) bytes): $(sec $t1 $t2) s"
}
readall; readall
prefill() {  # prefill TAG STREAMS CHUNK [BUFMIB]
  local sock=$W/p.sock; rm -f $sock
  GPUSNAP_TIER_PREFILL_STREAMS=$2 GPUSNAP_TIER_BUFFER_MIB=${4:-4} timeout 30 $B/gpusnap-tier-prefill $T $PID $sock "$UUID" 0 0 10000 -1 -1 $3 2>$R/prefill-$1.err &
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
  wait $pp; echo "== prefill $1 (workers $2, chunk $3, buffer ${4:-4} MiB) rc=$?: $(grep -h 'gpusnap-tier-prefill' $R/prefill-$1.err | tail -1)"
}
for round in 1 2; do
  for cfg in "h16 16 $CHUNK" "n16 16 0" "h8 8 $CHUNK" "n8 8 0" "h24 24 $CHUNK" "h32 32 $CHUNK" "h16b8 16 $CHUNK 8" "n32 32 0"; do
    (( $(left) > 15 )) || { echo "NOT RUN (time)"; break 2; }
    set -- $cfg; prefill $1-$round $2 $3 ${4:-4}
  done
  finish
done
rm -rf $W; finish
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
