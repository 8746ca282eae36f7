#!/usr/bin/env bash
# exp48: torch.compile(mode="reduce-overhead") on the memory tier, its CUDA graph trees turned
# off by use_memory_tier() when Inductor's configuration loads: the two new GPU tests (the one
# line, and `gpusnap run --memory-tier`), the transparent row of the same workload, and the
# tier's tests that go through the changed Python client. First: does `import torch` load
# Inductor's configuration, and what does loading it cost.
OUT=$1; DEADLINE=${2:-570}
R=$OUT/r; mkdir -p $R
exec >>"$R/exp48.log" 2>&1
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PATH=$PWD/.carry/runc:$PATH
B=$PWD/.carry/b48
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
cd $B/tests
for i in 1 2; do
timeout 60 python3 - <<'PY'
import sys, time
t0 = time.monotonic(); import torch; t1 = time.monotonic()
loaded = "torch._inductor.config" in sys.modules
import torch._inductor.config as c; t2 = time.monotonic()
print(f"IMPORT torch {t1-t0:.3f} s; inductor config loaded by it: {loaded}; "
      f"then torch._inductor.config {t2-t1:.3f} s; trees default {c.triton.cudagraph_trees}; "
      f"modules {len(sys.modules)}", flush=True)
PY
done
echo "== gpu tests, $(left) s left"; date -u
timeout $(( $(left) - 20 )) ./gpusnap_gpu_tests --gtest_filter='MemoryTier.TorchCompile*:Frameworks.TorchCompile*:MemoryTier.GpusnapRunInstallsTheTierWithoutTheOneLine:MemoryTier.FourGiB*:MemoryTier.GraphsReuse*' 2>&1 | tee $R/gpu-tests.log | grep -E "^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|skipped|Failure|tests ran|max_err|cudagraph_trees"
echo "rc=${PIPESTATUS[0]}"; date -u
