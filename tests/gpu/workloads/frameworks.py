"""Small workloads of real frameworks for gpusnap's GPU tests (docs/compatibility.md).

Each computes an answer on the GPU once, before any checkpoint, keeps it on the host, and then
serves line commands on TCP 127.0.0.1:--port (line_server.py), as torch_graph.py does:

  CHECK  -> OK max_err=0 pid=<pid> ...   computes again on the GPU (from state kept on the GPU:
            FAIL max_err=<e>               weights, compiled graphs, KV cache) and compares exactly
  INFO   -> pid=<pid> framework=<name> version=<v> ready_s=<start to ready> gpu_bytes=<...>
  QUIT   -> BYE

--framework picks the workload:
  torch-compile  an MLP under torch.compile(mode="reduce-overhead"): Triton kernels and Inductor's
                 CUDA graphs
  transformers   a LlamaForCausalLM (random bf16 weights, small shape), greedy generate() with
                 its KV cache; the tokens are the answer. With --cache-gib N it also leaves N GiB
                 of free blocks in PyTorch's cache (as a server's peak does); with a control
                 directory in GPUSNAP_CONTROL_DIR it speaks the handshake, whose client frees
                 them at the pause
  jax            a jitted MLP (XLA)
  cupy           CuPy arrays, a matrix product (cuBLAS) and an elementwise kernel (NVRTC)
  tree           a parent without CUDA that starts a CUDA worker (PyTorch) as a child process and
                 passes CHECK to it over a pipe

--ready-file PATH receives the port once ready (the time to then is the cold start).
--tier (torch-compile only) puts the workload on gpusnap's memory tier first
(gpusnap_handshake.use_memory_tier(), which turns off Inductor's CUDA graph trees); INFO then
also says cudagraph_trees=<0|1> tier_live_bytes=<B>.
"""

import argparse
import os
import subprocess
import sys
import time

import line_server

T0 = time.monotonic()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--framework", required=True,
                   choices=["torch-compile", "transformers", "jax", "cupy", "tree", "tree-worker"])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file")
    p.add_argument("--mib", type=int, default=256, help="weights, MiB")
    p.add_argument("--cache-gib", type=float, default=0.0)
    p.add_argument("--tier", action="store_true",
                   help="torch-compile: on gpusnap's memory tier (use_memory_tier())")
    p.add_argument("--cpu", action="store_true",
                   help="tree: a worker without CUDA, for tests on machines without a GPU")
    return p.parse_args()


def torch_compile(args):
    if args.tier:
        import gpusnap_handshake  # beside this file in the build tree
        gpusnap_handshake.use_memory_tier()  # before anything allocates
    import torch
    torch.manual_seed(1)
    dim = 4096  # few wide layers: Inductor's compile time grows with the layer count
    layers = max(1, args.mib * (1 << 20) // (dim * dim * 2))
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
                                  for _ in range(layers)]).to("cuda", torch.bfloat16)
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(8, dim, device="cuda", dtype=torch.bfloat16)

    def answer():
        with torch.no_grad():
            for _ in range(3):  # the CUDA graph is recorded on the second or third call
                y = compiled(x)
            return y.float().cpu()

    return answer, torch.__version__, "torch"


def transformers_generate(args):
    import torch
    import transformers
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=8, num_attention_heads=16,
                                      num_key_value_heads=4, vocab_size=32000,
                                      max_position_embeddings=2048)
    with torch.device("cuda"):  # initialised on the GPU: seconds faster than on the CPU
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 32), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7))

    def answer():
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=32, do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
        return out.cpu()

    if args.cache_gib > 0:
        # A peak's worth of temporaries, freed: PyTorch keeps the blocks cached.
        scratch = torch.empty(int(args.cache_gib * (1 << 30)), dtype=torch.uint8,  # noqa: F841
                              device="cuda")
        del scratch
    return answer, transformers.__version__, "torch"


def jax_mlp(args):
    import jax
    import jax.numpy as jnp
    dim = 2048
    layers = max(1, args.mib * (1 << 20) // (dim * dim * 4))
    keys = jax.random.split(jax.random.key(1), layers + 1)
    weights = [jax.random.normal(k, (dim, dim), jnp.float32) / dim**0.5 for k in keys[1:]]
    x = jax.random.normal(keys[0], (8, dim), jnp.float32)

    @jax.jit
    def forward(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    def answer():
        import numpy as np
        return np.asarray(forward(weights, x))

    return answer, jax.__version__, "jax"


def cupy_work(args):
    import cupy as cp
    dim = 2048
    rs = cp.random.RandomState(1)
    a = rs.standard_normal((dim, dim), dtype=cp.float32)
    b = rs.standard_normal((dim, dim), dtype=cp.float32)
    squash = cp.ElementwiseKernel("float32 x", "float32 y", "y = x / (1.0f + fabsf(x))", "squash")

    def answer():
        return cp.asnumpy(squash(a @ b))

    return answer, cp.__version__, "cupy"


def tree_worker(args):
    # The child: a CUDA process (without --cpu) that answers CHECK lines on its stdin, a pipe
    # from its parent, on its stdout, another pipe.
    if args.cpu:
        state = list(range(1, 100001))

        def compute():
            return sum(v * v for v in state)
    else:
        import torch
        torch.manual_seed(1)
        w = torch.randn(2048, 2048, device="cuda")
        x = torch.randn(8, 2048, device="cuda")

        def compute():
            return (x @ w).cpu()
    reference = compute()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "CHECK":
            got = compute()
            same = got == reference if args.cpu else bool((got == reference).all())
            print(f"OK max_err=0 worker={os.getpid()}" if same else "FAIL", flush=True)


def tree_parent(args):
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--framework",
                              "tree-worker"] + (["--cpu"] if args.cpu else []),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"

    def check():
        child.stdin.write("CHECK\n")
        child.stdin.flush()
        return child.stdout.readline().strip() or f"FAIL the worker is gone ({child.poll()})"

    return check, sys.version.split()[0], None


def gpu_bytes(kind):
    if kind == "torch":
        import torch
        tier = getattr(sys.modules.get("gpusnap_handshake"), "_installed_tier", None)
        if tier is not None:  # PyTorch keeps no figures for a pluggable allocator
            import torch._inductor.config as inductor
            return (f"cudagraph_trees={int(inductor.triton.cudagraph_trees)} "
                    f"tier_live_bytes={tier.live_bytes}")
        return f"allocated={torch.cuda.memory_allocated()} reserved={torch.cuda.memory_reserved()}"
    if kind == "jax":
        import jax
        stats = jax.devices()[0].memory_stats() or {}
        return f"in_use={stats.get('bytes_in_use', 0)} limit={stats.get('bytes_limit', 0)}"
    if kind == "cupy":
        import cupy as cp
        pool = cp.get_default_memory_pool()
        return f"used={pool.used_bytes()} total={pool.total_bytes()}"
    return "-"


def main():
    args = parse_args()
    if args.framework == "tree-worker":
        return tree_worker(args)
    handshake = None
    if args.framework == "tree":
        check, version, kind = tree_parent(args)
    else:
        make = {"torch-compile": torch_compile, "transformers": transformers_generate,
                "jax": jax_mlp, "cupy": cupy_work}[args.framework]
        answer, version, kind = make(args)
        reference = answer()
        import numpy as np
        reference = np.asarray(reference)

        def check():
            got = np.asarray(answer())
            if got.shape != reference.shape:
                return f"FAIL shape={got.shape}"
            err = float(np.abs(got.astype(np.float64) - reference.astype(np.float64)).max())
            return f"OK max_err=0 pid={os.getpid()}" if err == 0 else f"FAIL max_err={err:g}"

    ready_s = time.monotonic() - T0
    if os.environ.get("GPUSNAP_CONTROL_DIR"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpusnap_handshake
        handshake = gpusnap_handshake.Client.from_environment()
        handshake.ready()
        handshake.serve(on_pause=lambda: True, on_resume=lambda ctx: True)

    def info():
        return (f"pid={os.getpid()} framework={args.framework} version={version} "
                f"ready_s={ready_s:.2f} {gpu_bytes(kind)}")

    line_server.serve(args.port, args.ready_file, {"CHECK": check, "INFO": info},
                      banner=f"pid={os.getpid()} ready_s={ready_s:.2f}")


if __name__ == "__main__":
    main()
