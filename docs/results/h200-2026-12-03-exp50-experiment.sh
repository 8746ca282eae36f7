#!/usr/bin/env bash
# exp50: two open questions of the tier with PyTorch, measured.
# 1. torch.compile(backend="cudagraphs") on the tier (that backend's graphs, not Inductor's).
# 2. One graph pool shared by every capture (torch.cuda.graph(pool=...), as servers capture a
#    graph per batch size, largest first): the GPU memory the graphs take on PyTorch's own
#    allocator and on the tier, which keeps a pool per capture.
OUT=$1
R=$OUT/r; mkdir -p $R
exec >>"$R/exp50.log" 2>&1
B=$PWD/.carry/b48; export GPUSNAP_TIER_LIBRARY=$B/libgpusnap-tier.so
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cd $B/tests
echo "== 1. backend=cudagraphs on the tier"
timeout 120 python3 - <<'PY' 2>&1 | tail -4
import gpusnap_handshake
tier = gpusnap_handshake.use_memory_tier()
import torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
f = torch.compile(m, backend="cudagraphs")
x = torch.randn(64, 1024, device="cuda")
with torch.no_grad():
    ref = m(x)
    for i in range(5):
        y = f(x)
    torch.cuda.synchronize()
print("CUDAGRAPHS-BACKEND max_err", (y - ref).abs().max().item(), "live", tier.live_bytes)
PY
echo "== 2. one pool shared by every capture"
for mode in native tier; do
MODE=$mode timeout 180 python3 - <<'PY' 2>&1 | tail -3
import os
if os.environ["MODE"] == "tier":
    import gpusnap_handshake
    tier = gpusnap_handshake.use_memory_tier()
import torch
d, layers = 4096, 8
g = torch.Generator("cuda").manual_seed(11)
ws = [(torch.randn(d, 4 * d, device="cuda", generator=g).mul_(d ** -0.5).to(torch.bfloat16),
       torch.randn(4 * d, d, device="cuda", generator=g).mul_(d ** -0.5 / 2).to(torch.bfloat16))
      for _ in range(layers)]
def fwd(x):
    for w1, w2 in ws:
        x = x + torch.nn.functional.gelu(x @ w1) @ w2
    return x
def used():
    free, total = torch.cuda.mem_get_info()
    return total - free
torch.cuda.synchronize()
before = used()
pool = torch.cuda.graph_pool_handle()
graphs = []
side = torch.cuda.Stream()
for b in (2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
    x = torch.randn(b, d, device="cuda", generator=g).to(torch.bfloat16)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd(x)
    torch.cuda.current_stream().wait_stream(side)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr, pool=pool):
        y = fwd(x)
    gr.replay()
    torch.cuda.synchronize()
    graphs.append((gr, x, y, y.float().cpu().clone()))
worst = 0.0
for gr, x, y, ans in graphs:
    gr.replay(); torch.cuda.synchronize()
    worst = max(worst, (y.float().cpu() - ans).abs().max().item())
after = used()
print("SHARED-POOL", os.environ["MODE"], "graphs", len(graphs), "took", after - before,
      "max_err", worst, "tier_live", tier.live_bytes if os.environ["MODE"] == "tier" else 0)
PY
done
date -u
