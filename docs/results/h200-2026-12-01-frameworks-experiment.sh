#!/bin/bash
# The framework matrix (docs/compatibility.md) and the JAX fault experiment, one H200.
# bash .carry/h18/experiment.sh $OUT     (from the repository root; CRIU at .carry/criu)
OUT=${1:?out dir}
H=$PWD/.carry/h18
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
left() { echo $(( ${BUDGET:-330} - ($(date +%s) - T0) )); }
echo "== $(date -u +%FT%TZ) $(uname -r)"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c 'import torch, transformers, jax, cupy; print("torch", torch.__version__, "transformers", transformers.__version__, "jax", jax.__version__, "cupy", cupy.__version__)' 2>&1 | tail -1
mkdir -p /mnt/snaps && mount -t tmpfs -o huge=within_size,size=110g tmpfs /mnt/snaps && export TMPDIR=/mnt/snaps
# cuBLAS: the program was linked against libcublas.so.13 of CUDA 13.0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:$(python3 -c 'import nvidia.cublas, os; print(os.path.join(nvidia.cublas.__path__[0], "lib"))' 2>/dev/null)
ldd $H/tests/cublas_gemm | grep -i "cublas" || true
run_test() {  # FILTER LIMIT_S
  local l=$(left); [ "$l" -lt 20 ] && { echo "== skip $1: $l s left"; return; }
  local lim=$(( $2 < l ? $2 : l ))
  echo "== $(date -u +%T) test $1 (limit $lim s)"
  timeout -k 5 $lim $H/tests/gpusnap_gpu_tests --gtest_filter="$1" 2>&1 | tee -a "$OUT/gpu-tests.log" | grep -E 'RESULT|OK \]|FAILED|Failure|Expected|Which is|actual|skipped|rror|exit' | cut -c1-2500
  local rc=${PIPESTATUS[0]}
  echo "== $(date -u +%T) done $1 rc=$rc"
}
run_test 'Frameworks.JaxWithPreallocationIsRefused*' 45
run_test 'Frameworks.JaxWithPreallocationOff*' 45
run_test 'Frameworks.Transformers*' 90
run_test 'Frameworks.TorchCompile*' 90
run_test 'Frameworks.Cupy*' 40
run_test 'Frameworks.TwoProcessTree*' 40
run_test 'Frameworks.CppProgramWithCublas*' 40

# Why JAX with preallocation dies: the driver's lock + checkpoint alone, no CRIU, then watch.
jax_case() {  # NAME ENV...
  local name=$1; shift
  local l=$(left); [ "$l" -lt 25 ] && { echo "== skip jax $name: $l s left"; return; }
  echo "== $(date -u +%T) jax experiment: $name ($*)"
  rm -f /tmp/jr; dmesg > /tmp/dmesg0 2>/dev/null
  env "$@" python3 $H/tests/frameworks.py --framework jax --mib 512 --ready-file /tmp/jr > /tmp/jax-$name.log 2>&1 &
  local pid=$!
  for i in $(seq 200); do [ -s /tmp/jr ] && break; sleep 0.1; done
  [ -s /tmp/jr ] || { echo "not ready"; tail -3 /tmp/jax-$name.log; kill -9 $pid; return; }
  grep -oE '[^ ]*(jaxlib|jax_plugins|xla)[^ ]*\.so[^ ]*' /proc/$pid/maps | sort -u | head -5
  echo "threads: $(cat /proc/$pid/task/*/comm | sort | uniq -c | sort -rn | head -12 | tr -s ' \n' ' ')"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
  local t0=$(date +%s%N)
  $H/cuda-checkpoint-tool lock $pid 10000 && $H/cuda-checkpoint-tool checkpoint $pid
  local t1=$(date +%s%N); echo "lock+checkpoint $(( (t1-t0)/1000000 )) ms"
  local died=""
  for i in $(seq 300); do
    if ! kill -0 $pid 2>/dev/null || grep -q '^State:.*Z' /proc/$pid/status 2>/dev/null; then died=$(( ($(date +%s%N)-t1)/1000000 )); break; fi
    sleep 0.01
  done
  if [ -n "$died" ]; then wait $pid; echo "DIED ${died} ms after the checkpoint returned, wait status $?"
  else echo "alive 3 s after the checkpoint"; timeout 20 $H/cuda-checkpoint-tool restore $pid && timeout 10 $H/cuda-checkpoint-tool unlock $pid
       echo "after restore+unlock: $(timeout 15 bash -c "exec 3<>/dev/tcp/127.0.0.1/$(cat /tmp/jr); echo CHECK >&3; head -1 <&3")"; kill -9 $pid; fi
  dmesg 2>/dev/null | diff /tmp/dmesg0 - | grep '^>' | tail -4 | cut -c1-300
  tail -3 /tmp/jax-$name.log | cut -c1-300
}
jax_case prealloc-default XLA_PYTHON_CLIENT_MEM_FRACTION=0.25
jax_case prealloc-off XLA_PYTHON_CLIENT_PREALLOCATE=false
run_test 'TorchWorkload.CudaGraphReplaysAfterRestore' 70
jax_case prealloc-default-no-command-buffers XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 XLA_FLAGS=--xla_gpu_enable_command_buffer=
nvidia-smi --query-gpu=memory.used --format=csv,noheader
echo "== $(date -u +%T) end, $(( $(date +%s) - T0 )) s"
