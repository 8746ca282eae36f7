#!/usr/bin/env bash
# exp51: the GPU tests outside the memory tier's, on main with this stop's changes (the Python
# client's torch.compile switch, frameworks.py and torch_tp.py): containers, the KV cache,
# the framework matrix, PyTorch graphs and the CUDA workloads.
OUT=$1; DEADLINE=${2:-570}
R=$OUT/r; mkdir -p $R
exec >>"$R/exp51.log" 2>&1
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PATH=$PWD/.carry/runc:$PATH
B=$PWD/.carry/b48
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
cd $B/tests
timeout $(( $(left) - 15 )) ./gpusnap_gpu_tests --gtest_filter='GpuContainer.*:KvCache.*:Frameworks.*:TorchWorkload.*:CudaWorkload.*:MultiGpu.*:Remap.*' 2>&1 | tee $R/gpu-tests.log | grep -E "^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|skipped|Failure|tests ran|Expected|Which is|actual"
echo "rc=${PIPESTATUS[0]}"; date -u
