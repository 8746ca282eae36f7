"""A PyTorch workload that captures one CUDA graph per batch size, as inference servers do, each
graph the forward pass of an MLP whose temporaries are large: for the memory tier's graph
pools. It speaks the handshake, with or without gpusnap's memory tier (--tier / --no-tier).

It makes --layers layers of bf16 weights (--dim x 4*--dim and back) on the GPU from a fixed
seed, captures a graph for each of --batches, takes each graph's answer once, says READY, and
serves line commands on TCP 127.0.0.1:--port:

  CHECK   -> OK max_err=<e> graphs=<n> pid=<pid>     every graph replayed, against its answer
  INFO    -> pid=<pid> tier=<0|1> used_before=<B> used_after=<B> tier_live_bytes=<B>
  QUIT    -> BYE

used_before and used_after are the GPU's memory in use (cuMemGetInfo) once the weights are
made and once every graph is captured: their difference is what the graphs took, on PyTorch's
own allocator or on the tier.
"""

import argparse
import os
import sys
import time

T0 = time.monotonic()

import gpusnap_handshake  # noqa: E402  (beside this file in the build tree)
import line_server  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", default="1,16,128,512,2048")
    line_server.add_tier_workload_arguments(p)
    return p.parse_args()


def main():
    args = parse_args()
    tier = gpusnap_handshake.use_memory_tier() if args.tier else None
    import torch  # noqa: PLC0415

    gen = torch.Generator("cuda").manual_seed(11)
    d = args.dim
    scale = d ** -0.5
    weights = [(torch.randn(d, 4 * d, device="cuda", generator=gen).mul_(scale).to(torch.bfloat16),
                torch.randn(4 * d, d, device="cuda", generator=gen).mul_(scale / 2).to(torch.bfloat16))
               for _ in range(args.layers)]
    torch.cuda.synchronize()

    def used():
        free, total = torch.cuda.mem_get_info()
        return total - free

    def forward(x):
        for w1, w2 in weights:
            x = x + torch.nn.functional.gelu(x @ w1) @ w2
        return x

    used_before = used()
    graphs = []
    stream = torch.cuda.Stream()  # the warm-ups' side stream
    for b in (int(s) for s in args.batches.split(",")):
        static_x = torch.randn(b, d, device="cuda", generator=gen).to(torch.bfloat16)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(static_x)  # warm-up, as PyTorch asks before a capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = forward(static_x)
        graph.replay()
        torch.cuda.synchronize()
        graphs.append((graph, static_x, static_y, static_y.float().cpu().clone()))
    torch.cuda.synchronize()
    used_after = used()

    def check():
        worst = 0.0
        for graph, _, static_y, answer in graphs:
            graph.replay()
            torch.cuda.synchronize()
            worst = max(worst, (static_y.float().cpu() - answer).abs().max().item())
        return (f"OK max_err={worst:g} graphs={len(graphs)} pid={os.getpid()}" if worst == 0
                else f"FAIL max_err={worst:g}")

    def info():
        return (f"pid={os.getpid()} tier={int(tier is not None)} used_before={used_before} "
                f"used_after={used_after} tier_live_bytes={tier.live_bytes if tier else 0}")

    def on_pause():
        torch.cuda.synchronize()
        return True

    hs = gpusnap_handshake.Client.from_environment()
    hs.serve(on_pause, lambda context: True)
    hs.ready()
    line_server.serve(args.port, args.ready_file, {"CHECK": check, "INFO": info},
                      banner=f"pid={os.getpid()} ready_s={time.monotonic() - T0:.2f}")


if __name__ == "__main__":
    sys.exit(main())
