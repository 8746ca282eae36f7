#!/usr/bin/env bash
# exp43: the GPU tests of the memory tier and of its container path, on main after the tier's
# pieces moved a buffer at a time (09a5075).
OUT=$1; DEADLINE=${2:-570}
R=$OUT/r; mkdir -p $R
exec >>"$R/exp43.log" 2>&1
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PATH=$PWD/.carry/runc:$PATH
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
cd .carry/b43/tests
timeout $DEADLINE ./gpusnap_gpu_tests --gtest_filter='MemoryTier.*:GpuContainer.WithTheMemoryTierRestoresIntoAPlaceholderBitExact:GpuContainer.InitWithMemoryTierInstallsTheTierWithoutTheOneLine' 2>&1 | tee $R/gpu-tests.log | grep -E "^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|skipped|Failure|tests ran"
echo "rc=${PIPESTATUS[0]}"; date -u
