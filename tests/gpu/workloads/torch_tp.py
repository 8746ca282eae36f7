"""A tensor-parallel PyTorch workload for gpusnap's multi-GPU tests: one process per GPU.

The launcher (the root of the process tree, no CUDA of its own) starts --ranks rank processes.
Each rank joins an NCCL group (the collective) and a gloo group (CPU control), loads its shard
of the weights (--gib GiB per rank), captures its part of the forward pass in a CUDA graph, and
computes the full answer once: its graph's output summed over all ranks with an all-reduce.
Rank 0 serves line commands on TCP 127.0.0.1:--port:

  CHECK -> OK ranks=<n> max_err=<e>   every rank replays its graph, all-reduces, and compares
           FAIL ...                    with the answer computed before any checkpoint
  INFO  -> ranks=<n> gib=<g> pids=<rank pids> gpus=<rank GPU bus ids>
  QUIT  -> BYE (every rank and the launcher exit)

--tier: every rank allocates through gpusnap's memory tier (use_memory_tier()); rank 0 speaks
the handshake for all, its client draining and filling every rank's tier as one
(gpusnap_handshake.TierGroup), the other ranks reached over socketpairs the launcher made
(RankTier, served by serve_rank_tier in a thread of each rank).

--one-gpu puts every rank on GPU 0, the collective over gloo (NCCL takes one rank per GPU): the
tier's several processes and one handshake on a machine of one GPU.

The launcher sets NCCL's transports to sockets only (P2P, SHM, NVLS and cuMem off), which is what
the driver's checkpoint can carry across processes; --nccl-defaults leaves NCCL's defaults, for
the test that gpusnap refuses such a workload with the setting to change.
"""

import argparse
import os
import socket
import subprocess
import sys

import line_server


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file")
    p.add_argument("--nccl-defaults", action="store_true")
    p.add_argument("--rank", type=int, default=-1)  # internal: this process is a rank
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--tier", action="store_true")
    p.add_argument("--one-gpu", action="store_true")
    p.add_argument("--tier-fds", default="")  # internal: rank 0's ends of the ranks' socketpairs
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(args):
    env = dict(os.environ)
    if not args.nccl_defaults:
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NVLS_ENABLE="0",
                   NCCL_CUMEM_ENABLE="0", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
    # PyTorch's libuv-based TCPStore may use io_uring, which CRIU cannot capture.
    env.update(USE_LIBUV="0")
    master = free_port()
    # With --tier, a socketpair between rank 0 and every other rank: rank 0's client drains and
    # fills their tiers through it.
    pairs = [socket.socketpair() for _ in range(args.ranks - 1)] if args.tier else []
    procs = []
    for r in range(args.ranks):
        argv = [sys.executable, __file__, "--rank", str(r), "--ranks", str(args.ranks),
                "--gib", str(args.gib), "--dim", str(args.dim), "--port", str(args.port),
                "--master-port", str(master)]
        if r == 0 and args.ready_file:
            argv += ["--ready-file", args.ready_file]
        if args.one_gpu:
            argv.append("--one-gpu")
        fds = []
        if args.tier:
            fds = [a.fileno() for a, _ in pairs] if r == 0 else [pairs[r - 1][1].fileno()]
            argv += ["--tier", "--tier-fds", ",".join(map(str, fds))]
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, pass_fds=fds))
    for a, b in pairs:
        a.close()
        b.close()
    codes = [p.wait() for p in procs]
    sys.exit(max(codes))


def rank_main(args):
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.ranks
    tier_socks = [socket.socket(fileno=int(fd)) for fd in args.tier_fds.split(",") if fd]
    if args.tier:
        import gpusnap_handshake
        gpusnap_handshake.use_memory_tier()  # before this rank's first CUDA allocation
        if rank != 0:
            gpusnap_handshake.serve_rank_tier_in_background(tier_socks[0])
    device = 0 if args.one_gpu else rank
    torch.cuda.set_device(device)
    init = f"tcp://127.0.0.1:{args.master_port}"
    if args.one_gpu:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                device_id=torch.device("cuda", device))
    control = dist.new_group(backend="gloo")
    layers = max(1, int(args.gib * (1 << 30) / (args.dim * args.dim * 2)))
    gen = torch.Generator("cuda").manual_seed(100 + rank)
    weights = [(torch.randn(args.dim, args.dim, device="cuda", generator=gen) / args.dim**0.5)
               .to(torch.bfloat16) for _ in range(layers)]
    x = torch.randn(16, args.dim, device="cuda",
                    generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)

    def local_forward(v):
        for w in weights:
            v = torch.tanh(v @ w)
        return v

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        local_forward(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        partial = local_forward(x)

    def answer():
        graph.replay()
        # NCCL (gloo, through host memory, with --one-gpu): the collective must survive the
        # checkpoint.
        out = partial.float().cpu() if args.one_gpu else partial.float().clone()
        dist.all_reduce(out)
        torch.cuda.synchronize()
        return out

    reference = answer().cpu()
    bus = torch.cuda.get_device_properties(device).pci_bus_id if hasattr(
        torch.cuda.get_device_properties(device), "pci_bus_id") else str(device)
    info = torch.tensor([os.getpid()], dtype=torch.int64)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, info, group=control)

    def run(cmd):
        # rank 0 tells every rank what to do over the CPU group: a rank waiting here has no GPU
        # work in flight, so the driver's lock never waits on it.
        c = torch.tensor([cmd], dtype=torch.int64)
        dist.broadcast(c, src=0, group=control)
        if c.item() == 1:
            err = torch.tensor([(answer().cpu() - reference).abs().max().item()], dtype=torch.float64)
            dist.all_reduce(err, op=dist.ReduceOp.MAX, group=control)
            return err.item()
        return None

    if rank != 0:
        while True:
            c = torch.tensor([0], dtype=torch.int64)
            dist.broadcast(c, src=0, group=control)
            if c.item() == 1:
                err = torch.tensor([(answer().cpu() - reference).abs().max().item()],
                                   dtype=torch.float64)
                dist.all_reduce(err, op=dist.ReduceOp.MAX, group=control)
            elif c.item() == 2:
                return

    def check():
        err = run(1)
        return f"OK ranks={world} max_err={err:g}" if err == 0 else f"FAIL max_err={err:g}"

    def info():
        return (f"ranks={world} gib={args.gib:g} pids={','.join(str(int(p.item())) for p in pids)} "
                f"gpu0={bus}")

    if not args.tier:
        line_server.serve(args.port, args.ready_file, {"CHECK": check, "INFO": info},
                          banner=f"ranks={world}", on_quit=lambda: run(2))
        return
    # Rank 0 speaks the handshake for every rank: its client drains and fills them all. The
    # port is listened on before READY, so that the capture holds it.
    srv = line_server.listen(args.port)
    tiers = [gpusnap_handshake.use_memory_tier()] + [
        gpusnap_handshake.RankTier(s) for s in tier_socks]
    hs = gpusnap_handshake.Client.from_environment(memory_tier=gpusnap_handshake.TierGroup(tiers))
    hs.serve(lambda: torch.cuda.synchronize() or True, None)
    hs.ready()
    print(f"ready port={srv.getsockname()[1]} ranks={world} tier=1", flush=True)
    if args.ready_file:
        line_server.write_ready_file(args.ready_file, srv.getsockname()[1])
    commands = {"CHECK": check, "INFO": info}
    line_server.serve_lines(srv, lambda cmd: commands[cmd]() if cmd in commands
                            else "ERR unknown command", on_quit=lambda: run(2))

if __name__ == "__main__":
    a = parse_args()
    if a.rank >= 0:
        rank_main(a)
    else:
        launcher(a)
