#!/usr/bin/env bash
# exp45: the tier's graph pools. One CUDA graph per batch size (tests/graph_pools.py) on
# PyTorch's own allocator, on the tier as built now, and on the tier as it was (ddf08ac: a
# capture's blocks never reused); then the new GPU test and the memory tier's GPU tests; then a
# probe of torch.compile's reduce-overhead mode on the tier.
OUT=$1; DEADLINE=${2:-570}
R=$OUT/r; mkdir -p $R
exec >>"$R/exp45.log" 2>&1
START=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
export GPUSNAP_CRIU=$PWD/.carry/criu/criu PATH=$PWD/.carry/runc:$PATH
B=$PWD/.carry/b45
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
cd $B/tests
one() {  # name, then the workload's arguments; env before the call picks the library
  local name=$1; shift
  rm -f $R/$name.port
  timeout 200 python3 graph_pools.py --ready-file $R/$name.port "$@" > $R/$name.out 2>&1 &
  local pid=$!
  for _ in $(seq 1 1800); do [ -s $R/$name.port ] && break; sleep 0.1; done
  local port; port=$(cat $R/$name.port 2>/dev/null)
  echo "== $name"
  python3 - "$port" <<'PY'
import socket, sys
port = int(sys.argv[1])
for cmd in ("CHECK", "INFO", "QUIT"):
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall((cmd + "\n").encode()); print(cmd, "->", s.makefile().readline().strip(), flush=True)
        if cmd == "QUIT": break
PY
  wait $pid; echo "rc=$?"; tail -3 $R/$name.out
}
one native --no-tier
one tier-new --tier
GPUSNAP_TIER_LIBRARY=$B/old/libgpusnap-tier.so one tier-old --tier
echo "== gpu tests, $(left) s left"; date -u
timeout $(( $(left) - 60 )) ./gpusnap_gpu_tests --gtest_filter='MemoryTier.*' 2>&1 | tee $R/gpu-tests.log | grep -E "^\[ +(RUN|OK|FAILED|SKIPPED|PASSED) +\]|skipped|Failure|tests ran|RESULT tier-graph-pools"
echo "rc=${PIPESTATUS[0]}"; date -u
echo "== torch.compile reduce-overhead on the tier, $(left) s left"
timeout 50 python3 - <<'PY' 2>&1 | tail -15
import gpusnap_handshake
tier = gpusnap_handshake.use_memory_tier()
import torch
m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
f = torch.compile(m, mode="reduce-overhead")
x = torch.randn(64, 1024, device="cuda")
with torch.no_grad():
    ref = m(x)
    for i in range(4):
        y = f(x)
    torch.cuda.synchronize()
print("COMPILE", "max_err", (y - ref).abs().max().item(), "live", tier.live_bytes)
PY
date -u
