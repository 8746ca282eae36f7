#!/usr/bin/env bash
# exp49: two ranks of tests/torch_tp.py on one GPU, each with its own memory tier (the new
# MemoryTier.TwoRanksOnOneGpuEachWithTheirOwnTier), then every other test of the tier on this
# build (main with the torch.compile change).
OUT=$1; DEADLINE=${2:-570}
R=$OUT/r; mkdir -p $R
exec >>"$R/exp49.log" 2>&1
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PATH=$PWD/.carry/runc:$PATH
B=$PWD/.carry/b48
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
cd $B/tests
for f in 'MemoryTier.TwoRanks*' 'MemoryTier.*:-MemoryTier.TwoRanks*'; do
timeout $(( $(left) - 20 )) ./gpusnap_gpu_tests --gtest_filter="$f" 2>&1 | tee -a $R/gpu-tests.log | grep -E "^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|skipped|Failure|tests ran|Expected|Which is|actual"
echo "rc=${PIPESTATUS[0]}"; date -u
done
