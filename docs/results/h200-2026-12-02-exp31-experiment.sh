#!/usr/bin/env bash
# exp31 (issue 17): the tier's GPU tests (MemoryTier.*) on the build whose drain frees the GPU
# threads' stacks and whose fill puts them back (exp30).
OUT=$1; DEADLINE=${2:-540}
T0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
R=$OUT/r; mkdir -p $R
exec >>"$R/exp31.log" 2>&1
export GPUSNAP_CRIU=$PWD/.carry/criu/criu
B=.carry/b29
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
S=/mnt/gpusnap-store; mkdir -p $S && mount -t tmpfs -o huge=within_size,size=70g gpusnap $S
cd $B/tests
echo "== gpu tests t=$(( $(date +%s) - T0 ))s"
timeout $(( $(left) - 10 )) ./gpusnap_gpu_tests --gtest_filter='MemoryTier.*:MultiGpu.*' > $R/gpu-tests.log 2>&1
echo "== gpu tests rc=$?"; grep -E "^\[ +(OK|FAILED|RUN|PASSED|SKIPPED) " $R/gpu-tests.log
cd - >/dev/null
umount $S
echo "done t=$(( $(date +%s) - T0 ))s"
