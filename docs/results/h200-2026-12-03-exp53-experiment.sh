#!/usr/bin/env bash
# exp53: gpusnap killed after the memory tier's drain (the new
# MemoryTier.GpusnapKilledAfterTheDrainLeavesTheWorkloadServingWithItsMemory), twice.
OUT=$1; DEADLINE=${2:-400}
R=$OUT/r; mkdir -p $R
exec >>"$R/exp53.log" 2>&1
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PATH=$PWD/.carry/runc:$PATH
B=$PWD/.carry/b48
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cd $B/tests
timeout $(( $(left) - 15 )) ./gpusnap_gpu_tests --gtest_filter='MemoryTier.GpusnapKilledAfterTheDrain*' --gtest_repeat=2 2>&1 | tee $R/gpu-tests.log | grep -E "^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|skipped|Failure|tests ran|Expected|Which is|actual|RESULT"
echo "rc=${PIPESTATUS[0]}"; date -u
