"""The PyTorch workload of torch_graph.py, speaking the handshake, with or without gpusnap's
memory tier: for the tier's GPU tests and its benchmark against the transparent path.

With --tier (the default) it calls gpusnap_handshake.use_memory_tier() before anything touches
CUDA, so every tensor (weights, activations, the CUDA graph's memory) comes from
libgpusnap-tier.so; with --no-tier the same program runs on PyTorch's own allocator. It loads
--gib GiB of bf16 weights from a file, captures the forward pass in a CUDA graph, computes the
answer once, says READY over the handshake, and serves line commands on TCP 127.0.0.1:--port:

  PING    -> PONG
  CHECK   -> OK max_err=<e> replays=<n> pid=<pid>    the graph replayed, against the answer
  VERIFY  -> OK layers=<L> bytes=<B>                 every weight, bit for bit, against the file
             FAIL layer=<i>
  INFO    -> pid=<pid> gib=<N> layers=<L> tier=<0|1> tier_live_bytes=<B> ready_s=<s>
  QUIT    -> BYE

--ready-file PATH receives the port once READY was said (atomically).
"""

import argparse
import os
import socket
import sys
import time

T0 = time.monotonic()

import gpusnap_handshake  # noqa: E402  (beside this file in the build tree)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--weights", required=True)
    p.add_argument("--ready-file")
    p.add_argument("--tier", dest="tier", action="store_true", default=True)
    p.add_argument("--no-tier", dest="tier", action="store_false")
    return p.parse_args()


def main():
    args = parse_args()
    tier = gpusnap_handshake.use_memory_tier() if args.tier else None  # before any allocation
    import torch  # noqa: PLC0415  (after the allocator is chosen)

    layers = max(1, int(args.gib * (1 << 30) / (args.dim * args.dim * 2)))
    per_layer = args.dim * args.dim * 2
    if not os.path.exists(args.weights):
        gen = torch.Generator("cuda").manual_seed(1234)
        tmp = args.weights + ".tmp"
        with open(tmp, "wb") as f:
            for _ in range(layers):
                w = (torch.randn(args.dim, args.dim, device="cuda", generator=gen)
                     / args.dim**0.5).to(torch.bfloat16)
                f.write(w.view(torch.int16).cpu().numpy().tobytes())
        os.rename(tmp, args.weights)

    def read_layer(f):
        buf = torch.frombuffer(bytearray(f.read(per_layer)), dtype=torch.int16)
        return buf.view(torch.bfloat16).view(args.dim, args.dim)

    with open(args.weights, "rb") as f:
        weights = [read_layer(f).to("cuda") for _ in range(layers)]
    static_x = torch.randn(16, args.dim, device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)

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

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", args.port))
    srv.listen(16)
    port = srv.getsockname()[1]

    def on_pause():
        torch.cuda.synchronize()  # nothing in flight; the tier synchronises again itself
        return True

    def on_resume(context):
        print(f"resumed restored={context.restored} copy={context.copy} "
              f"tier_dir={context.tier_dir!r} t={time.time():.3f}", flush=True)
        return True

    hs = gpusnap_handshake.Client.from_environment()
    hs.serve(on_pause, on_resume)
    hs.ready()
    print(f"ready port={port} pid={os.getpid()} ready_s={ready_s:.2f} tier={int(tier is not None)}",
          flush=True)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        os.rename(args.ready_file + ".tmp", args.ready_file)

    replays = 0
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw") as io:
            for line in io:
                cmd = line.strip()
                if cmd == "PING":
                    reply = "PONG"
                elif cmd == "CHECK":
                    graph.replay()
                    torch.cuda.synchronize()
                    replays += 1
                    err = (static_y.float().cpu() - reference).abs().max().item()
                    reply = (f"OK max_err={err:g} replays={replays} pid={os.getpid()}" if err == 0
                             else f"FAIL max_err={err:g}")
                elif cmd == "VERIFY":
                    reply = f"OK layers={layers} bytes={layers * per_layer}"
                    with open(args.weights, "rb") as f:
                        for i, w in enumerate(weights):
                            if not torch.equal(w.view(torch.int16),
                                               read_layer(f).view(torch.int16).to("cuda")):
                                reply = f"FAIL layer={i}"
                                break
                elif cmd == "INFO":
                    reply = (f"pid={os.getpid()} gib={args.gib:g} layers={layers} "
                             f"tier={int(tier is not None)} "
                             f"tier_live_bytes={tier.live_bytes if tier else 0} "
                             f"ready_s={ready_s:.2f}")
                elif cmd == "QUIT":
                    io.write("BYE\n")
                    io.flush()
                    return
                else:
                    reply = "ERR unknown command"
                io.write(reply + "\n")
                io.flush()


if __name__ == "__main__":
    sys.exit(main())
