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


T0 = time.monotonic()

import torch  # noqa: E402  (timed: importing torch is part of a cold start)

from line_server import listen, serve_lines, write_ready_file  # noqa: E402  (beside this file)


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


def capture(weights, dim):
    """The forward pass over `weights` captured in a CUDA graph (warmed up on a side stream, as
    PyTorch asks), replayed once: (graph, its input tensor, its output tensor, that output on
    the CPU). The caller keeps the input alive: the graph reads it at every replay."""
    static_x = torch.randn(16, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)

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
    return graph, static_x, static_y, static_y.float().cpu().clone()


class Checker:
    """CHECK: replays the graph and compares its output with the answer taken before."""

    def __init__(self, graph, static_x, static_y, reference):
        self.graph, self.static_x, self.static_y = graph, static_x, static_y
        self.reference, self.replays = reference, 0

    def check(self):
        self.graph.replay()
        torch.cuda.synchronize()
        self.replays += 1
        err = (self.static_y.float().cpu() - self.reference).abs().max().item()
        return (f"OK max_err={err:g} replays={self.replays} pid={os.getpid()}" if err == 0
                else f"FAIL max_err={err:g}")


def main():
    args = parse_args()
    layers = max(1, int(args.gib * (1 << 30) / (args.dim * args.dim * 2)))
    if not os.path.exists(args.weights):
        make_weights(args.weights, layers, args.dim)
    t_load = time.monotonic()
    weights = load_weights(args.weights, layers, args.dim)
    checker = Checker(*capture(weights, args.dim))
    ready_s = time.monotonic() - T0

    srv = listen(args.port)
    port = srv.getsockname()[1]
    print(f"ready port={port} pid={os.getpid()} ready_s={ready_s:.2f} load_s={time.monotonic() - t_load:.2f}", flush=True)
    if args.ready_file:
        write_ready_file(args.ready_file, port)

    def handle(cmd):
        if cmd == "PING":
            return "PONG"
        if cmd == "CHECK":
            return checker.check()
        if cmd == "INFO":
            return (f"pid={os.getpid()} gib={args.gib:g} layers={layers} "
                    f"device={torch.cuda.get_device_name()} ready_s={ready_s:.2f}")
        return "ERR unknown command"

    serve_lines(srv, handle)


if __name__ == "__main__":
    main()
