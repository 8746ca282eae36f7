"""The PyTorch workload of torch_graph.py, speaking the handshake, with or without gpusnap's
memory tier: for the tier's GPU tests and its benchmark against the transparent path.

With --tier (the default) it calls gpusnap_handshake.use_memory_tier() before anything touches
CUDA, so every tensor (weights, activations, the CUDA graph's memory) comes from
libgpusnap-tier.so; with --no-tier the same program runs on PyTorch's own allocator. With
--tier-by-gpusnap it does not call use_memory_tier() but expects the tier that
`gpusnap run --memory-tier` installs when it imports torch (it exits 3 when there is none), and
uses the handshake client exactly as with --tier. It loads
--gib GiB of bf16 weights from a file, captures the forward pass in a CUDA graph, computes the
answer once, says READY over the handshake, and serves line commands on TCP 127.0.0.1:--port:

  PING    -> PONG
  CHECK   -> OK max_err=<e> replays=<n> pid=<pid>    the graph replayed, against the answer
  VERIFY  -> OK layers=<L> bytes=<B>                 every weight, bit for bit, against the file
             FAIL layer=<i>
  INFO    -> pid=<pid> gib=<N> layers=<L> tier=<0|1> tier_live_bytes=<B> ready_s=<s>
             loops=<n> loop_error=<exception name or ->  (--request-loop's steps)
  QUIT    -> BYE

--ready-file PATH receives the port once READY was said (atomically).
"""

import argparse
import os
import sys
import threading
import time
import traceback

T0 = time.monotonic()

import gpusnap_handshake  # noqa: E402  (beside this file in the build tree, as torch_graph.py is)
import line_server  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--weights", required=True)
    line_server.add_tier_workload_arguments(p)
    p.add_argument("--request-loop", action="store_true",
                   help="a serving thread that runs GPU work without a break, each step inside "
                        "the handshake's gpu_work() gate, so that a pause holds it")
    p.add_argument("--tier-by-gpusnap", action="store_true",
                   help="the tier installed by `gpusnap run --memory-tier`, not by this program")
    return p.parse_args()


def main():
    args = parse_args()
    by_gpusnap = args.tier and args.tier_by_gpusnap
    # Before any allocation; under --tier-by-gpusnap, gpusnap's sitecustomize does it at the
    # import of torch below.
    tier = gpusnap_handshake.use_memory_tier() if args.tier and not by_gpusnap else None
    # The workload itself is torch_graph.py's; importing it imports torch, which allocates
    # nothing on the GPU yet.
    import torch  # noqa: PLC0415
    import torch_graph  # noqa: PLC0415

    if by_gpusnap:
        tier = gpusnap_handshake._installed_tier  # what the client drains and fills
        if tier is None:
            print("torch_tier: --tier-by-gpusnap, and no tier was installed at `import torch` "
                  "(run it with `gpusnap run --memory-tier`)", file=sys.stderr, flush=True)
            return 3

    layers = max(1, int(args.gib * (1 << 30) / (args.dim * args.dim * 2)))
    per_layer = args.dim * args.dim * 2
    if not os.path.exists(args.weights):
        torch_graph.make_weights(args.weights, layers, args.dim)
    weights = torch_graph.load_weights(args.weights, layers, args.dim)
    checker = torch_graph.Checker(*torch_graph.capture(weights, args.dim))
    ready_s = time.monotonic() - T0
    srv = line_server.listen(args.port)
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
    loops = [0]
    loop_error = [""]
    if args.request_loop:
        # A request loop as a threaded server runs one: its own tensors on the tier, a step
        # after another. Outside the gate a step could run while the drain has taken the memory.
        x = torch.randn(2048, 2048, device="cuda")

        def request_loop():
            try:
                while True:
                    with hs.gpu_work():
                        (x @ x).sum().item()
                    loops[0] += 1
            except BaseException as e:  # said in INFO and the log: a dead loop is the test's answer
                loop_error[0] = type(e).__name__
                traceback.print_exc()
                sys.stderr.flush()

        threading.Thread(target=request_loop, daemon=True).start()
    hs.ready()
    print(f"ready port={port} pid={os.getpid()} ready_s={ready_s:.2f} tier={int(tier is not None)}",
          flush=True)
    if args.ready_file:
        line_server.write_ready_file(args.ready_file, port)

    def verify():
        # Every weight, bit for bit, against the file (one layer on the GPU at a time).
        with open(args.weights, "rb") as f:
            for i, w in enumerate(weights):
                layer = torch.frombuffer(bytearray(f.read(per_layer)), dtype=torch.int16)
                if not torch.equal(w.view(torch.int16).flatten(), layer.to("cuda")):
                    return f"FAIL layer={i}"
        return f"OK layers={layers} bytes={layers * per_layer}"

    def handle(cmd):
        if cmd == "PING":
            return "PONG"
        if cmd == "CHECK":
            return checker.check()
        if cmd == "VERIFY":
            return verify()
        if cmd == "INFO":
            return (f"pid={os.getpid()} gib={args.gib:g} layers={layers} "
                    f"tier={int(tier is not None)} "
                    f"tier_live_bytes={tier.live_bytes if tier else 0} ready_s={ready_s:.2f} "
                    f"loops={loops[0]} loop_error={loop_error[0] or '-'}")
        return "ERR unknown command"

    line_server.serve_lines(srv, handle)


if __name__ == "__main__":
    sys.exit(main())
