#!/usr/bin/env bash
# exp47: torch.compile's reduce-overhead mode on the tier (exp46: its CUDA graph trees refuse a
# pluggable allocator), with the trees turned off, against the answer without compile.
OUT=$1
R=$OUT/r; mkdir -p $R
exec >>"$R/exp47.log" 2>&1
B=$PWD/.carry/b45; export GPUSNAP_TIER_LIBRARY=$B/libgpusnap-tier.so
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cd $B/tests
for trees in 1 0; do
echo "== cudagraph_trees=$trees"
TREES=$trees timeout 120 python3 - <<'PY' 2>&1 | tail -6
import os
import gpusnap_handshake
tier = gpusnap_handshake.use_memory_tier()
import torch
import torch._inductor.config as cfg
cfg.triton.cudagraph_trees = os.environ["TREES"] == "1"
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
f = torch.compile(m, mode="reduce-overhead")
x = torch.randn(64, 1024, device="cuda")
with torch.no_grad():
    ref = m(x)
    for i in range(5):
        y = f(x)
    torch.cuda.synchronize()
print("COMPILE trees", cfg.triton.cudagraph_trees, "max_err", (y - ref).abs().max().item(), "live", tier.live_bytes, "torch", torch.__version__)
PY
done
date -u
