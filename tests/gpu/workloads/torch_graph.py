"""A PyTorch inference-like workload for gpusnap's GPU tests and benchmarks.

It does what a model server does at start-up, in miniature: loads weights from a file onto the
GPU (bf16 matrices, --gib GiB in all), warms up, and captures the forward pass in a CUDA graph.
It computes the answer to a fixed input once, before any checkpoint, and keeps it. Then it
serves line commands on TCP 127.0.0.1:--port:

  PING   -> PONG
  CHECK  -> OK max_err=<e> replays=<n> pid=<pid>   replays the graph, compares with the answer
            FAIL max_err=<e>                          computed before the checkpoint
  INFO   -> pid=<pid> gib=<N> layers=<L> device=<name> ready_s=<seconds from start to ready>
  QUIT   -> BYE

--ready-file PATH receives the port (atomically) once the graph is captured: the time to that
point is the cold start a restore competes with. The weights file is made by --make-weights
if missing (random, seeded), so the load reads real bytes from storage as a server would.
"""

import argparse
import os
import time

import line_server

T0 = time.monotonic()

import torch  # noqa: E402  (timed: importing torch is part of a cold start)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--weights", required=True)
    p.add_argument("--ready-file")
    return p.parse_args()


def make_weights(path, layers, dim):
    # Generated on the GPU (seconds, not minutes, for 16 GiB), stored as a server's file is.
    gen = torch.Generator("cuda").manual_seed(1234)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for _ in range(layers):
            w = (torch.randn(dim, dim, device="cuda", generator=gen) / dim**0.5).to(torch.bfloat16)
            f.write(w.view(torch.int16).cpu().numpy().tobytes())
    os.rename(tmp, path)


def load_weights(path, layers, dim):
    per_layer = dim * dim * 2
    weights = []
    with open(path, "rb") as f:
        for _ in range(layers):
            buf = torch.frombuffer(bytearray(f.read(per_layer)), dtype=torch.int16)
            weights.append(buf.view(torch.bfloat16).view(dim, dim).to("cuda", non_blocking=False))
    return weights


def main():
    args = parse_args()
    layers = max(1, int(args.gib * (1 << 30) / (args.dim * args.dim * 2)))
    if not os.path.exists(args.weights):
        make_weights(args.weights, layers, args.dim)
    t_load = time.monotonic()
    weights = load_weights(args.weights, layers, args.dim)

    static_x = torch.randn(16, args.dim, device="cuda", generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)

    def forward(x):
        for w in weights:
            x = torch.tanh(x @ w)
        return x

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = forward(static_x)
    graph.replay()
    torch.cuda.synchronize()
    reference = static_y.float().cpu().clone()
    ready_s = time.monotonic() - T0

    load_s = time.monotonic() - t_load
    replays = 0

    def check():
        nonlocal replays
        graph.replay()
        torch.cuda.synchronize()
        replays += 1
        err = (static_y.float().cpu() - reference).abs().max().item()
        return (f"OK max_err={err:g} replays={replays} pid={os.getpid()}" if err == 0
                else f"FAIL max_err={err:g}")

    def info():
        return (f"pid={os.getpid()} gib={args.gib:g} layers={layers} "
                f"device={torch.cuda.get_device_name()} ready_s={ready_s:.2f}")

    line_server.serve(args.port, args.ready_file,
                      {"PING": lambda: "PONG", "CHECK": check, "INFO": info},
                      banner=f"pid={os.getpid()} ready_s={ready_s:.2f} load_s={load_s:.2f}")


if __name__ == "__main__":
    main()
