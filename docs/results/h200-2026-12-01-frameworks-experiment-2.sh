#!/bin/bash
# Second run: the two-process tree after the pipe fix, and what JAX's fault needs.
OUT=${1:?out dir}
H=$PWD/.carry/h18
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run2.log") 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-150} - ($(date +%s) - T0) )); }
echo "== $(date -u +%FT%TZ) $(uname -r)"
mkdir -p /mnt/snaps && mount -t tmpfs -o huge=within_size,size=110g tmpfs /mnt/snaps && export TMPDIR=/mnt/snaps
echo "== $(date -u +%T) test tree"
timeout -k 5 40 $H/tests/gpusnap_gpu_tests --gtest_filter='Frameworks.TwoProcessTree*' 2>&1 | tee -a "$OUT/gpu-tests2.log" | grep -E 'RESULT|OK \]|FAILED|Failure|Which is|output' | cut -c1-2500

start_jax() {  # NAME MIB ENV...
  local name=$1 mib=$2; shift 2
  rm -f /tmp/jr; dmesg > /tmp/dmesg0 2>/dev/null
  env "$@" python3 $H/tests/frameworks.py --framework jax --mib $mib --ready-file /tmp/jr > /tmp/jax-$name.log 2>&1 &
  JPID=$!
  for i in $(seq 300); do [ -s /tmp/jr ] && break; sleep 0.1; done
  [ -s /tmp/jr ] || { echo "not ready"; tail -3 /tmp/jax-$name.log; kill -9 $JPID; return 1; }
  for t in /proc/$JPID/task/*; do echo "$(basename $t):$(cat $t/comm):$(cut -d' ' -f1 $t/syscall 2>/dev/null)"; done | tr '\n' ' ' > /tmp/threads-$name; echo
}
ask() { timeout 15 bash -c "exec 3<>/dev/tcp/127.0.0.1/$(cat /tmp/jr); echo CHECK >&3; head -1 <&3" 2>&1; }
kernel() { dmesg 2>/dev/null | diff /tmp/dmesg0 - | grep '^>' | grep -v 'Code:' | tail -3 | cut -c1-260; }

echo "== $(date -u +%T) jax 4 GiB, preallocation off, through gpusnap checkpoint (source stopped at the commit)"
if start_jax big 4096 XLA_PYTHON_CLIENT_PREALLOCATE=false; then
  echo "before: $(ask)"
  timeout 60 $H/gpusnap checkpoint -p $JPID -o /mnt/snaps/jax-big; echo "exit $?"
  ls -d /mnt/snaps/jax-big 2>&1 | head -1
  sleep 0.3; kill -0 $JPID 2>/dev/null && echo "source alive: $(ask)" || echo "source gone"
  kernel; kill -9 $JPID 2>/dev/null; wait $JPID 2>/dev/null
fi

echo "== $(date -u +%T) jax 512 MiB, preallocation off: checkpoint, SIGSTOP at once, 3 s, restore while stopped, SIGCONT, unlock"
if start_jax stop 512 XLA_PYTHON_CLIENT_PREALLOCATE=false; then
  $H/cuda-checkpoint-tool lock $JPID 10000 && $H/cuda-checkpoint-tool checkpoint $JPID && kill -STOP $JPID
  echo "checkpointed and stopped"; sleep 3
  grep State /proc/$JPID/status
  timeout 20 $H/cuda-checkpoint-tool restore $JPID; echo "restore while stopped: exit $?"
  kill -CONT $JPID; timeout 10 $H/cuda-checkpoint-tool unlock $JPID; echo "unlock: exit $?"
  sleep 3; kill -0 $JPID 2>/dev/null && echo "alive 3 s later: $(ask)" || echo "died"
  kernel; echo "threads before: $(cat /tmp/threads-stop | cut -c1-1500)"
  kill -9 $JPID 2>/dev/null; wait $JPID 2>/dev/null
fi

echo "== $(date -u +%T) jax 512 MiB, preallocation on (fraction 0.05): checkpoint and restore at once, then 3 s"
if [ $(left) -gt 30 ] && start_jax quick 512 XLA_PYTHON_CLIENT_MEM_FRACTION=0.05; then
  t0=$(date +%s%N)
  $H/cuda-checkpoint-tool lock $JPID 10000 && $H/cuda-checkpoint-tool checkpoint $JPID && $H/cuda-checkpoint-tool restore $JPID && $H/cuda-checkpoint-tool unlock $JPID
  echo "round trip $(( ($(date +%s%N)-t0)/1000000 )) ms, exit $?"
  sleep 3; kill -0 $JPID 2>/dev/null && echo "alive 3 s later: $(ask)" || echo "died"
  kernel; echo "threads before: $(cat /tmp/threads-quick | cut -c1-1500)"
  kill -9 $JPID 2>/dev/null; wait $JPID 2>/dev/null
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
echo "== $(date -u +%T) end, $(( $(date +%s) - T0 )) s"
