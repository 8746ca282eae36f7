# What a CUDA context holds on the GPU besides PyTorch's memory, and what the stack limit costs.
import ctypes, subprocess, sys, time
import torch

cuda = ctypes.CDLL("libcuda.so.1")
CU_LIMIT = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2}


def limit(name):
    v = ctypes.c_size_t()
    rc = cuda.cuCtxGetLimit(ctypes.byref(v), CU_LIMIT[name])
    return v.value if rc == 0 else f"rc={rc}"


def set_limit(name, value):
    return cuda.cuCtxSetLimit(CU_LIMIT[name], ctypes.c_size_t(value))


def used(tag):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    u = total - free
    r = torch.cuda.memory_reserved()
    print(f"{tag}: used {u/2**20:.1f} MiB, torch reserved {r/2**20:.1f} MiB, "
          f"other {(u-r)/2**20:.1f} MiB; stack {limit('stack')} printf {limit('printf_fifo')} "
          f"heap {limit('malloc_heap')}", flush=True)


torch.zeros(1, device="cuda")
used("context + 1 tensor")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = a @ a
used("after a bf16 matmul")
x = torch.randn(4096, 4096, device="cuda")
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(3):
        y = torch.relu(x @ x).sum(1)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = torch.relu(x @ x).sum(1)
g.replay()
used("after a CUDA graph")
torch.cuda.empty_cache()
used("after empty_cache")
for v in (1024, 512, 0):
    rc = set_limit("stack", v)
    used(f"stack limit set to {v} (rc={rc})")
g.replay()
used("after a replay with the small stack")
print(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                     capture_output=True, text=True).stdout, flush=True)
