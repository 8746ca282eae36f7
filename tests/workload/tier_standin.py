"""A CPU workload whose "GPU memory" is a bytearray moved by a stand-in for libgpusnap-tier.so:
it drains into the folder the pause names and fills back from the one the resume names, through
the real Python handshake client, exactly as the tier does (docs/memory-tier.md).
It lets the system tests run gpusnap's side of the tier (the folder, its checks, the manifest,
verify, the resume contexts, the guardian) with real CRIU on a machine without a GPU.

  python3 tier_standin.py --mib N [--drain-delay S] [--ranks R] [--port N] [--ready-file PATH]

--ranks R > 1 plays a tensor-parallel workload: R processes, each with its own tier, the first
speaking the handshake for all (gpusnap_handshake.TierGroup), the others (forked children)
reached over socketpairs (RankTier, serve_rank_tier).

Serves line commands on TCP 127.0.0.1 (--port, or a free port named in --ready-file):
  CHECK -> OK ranks=<R> | FAIL ... | ERR drained    every rank's memory against its digest
  INFO  -> pid=<pid> restored=<0|1> copy=<i> tier_dir=<path> drains=<n> fills=<n>
           [rank_pids=<p,...> rank_fills=<n,...>]
"""

import argparse
import hashlib
import os
import socket
import subprocess
import sys
import time

import gpusnap_handshake
import line_server


# The tier's folder format is the tier's own code's (src/tier/folder_format.h): this program,
# built beside this file (tests/workload/tier_folder_tool.cc), names the drain file and writes the
# index.
FOLDER_TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tier-folder-tool")


def folder_tool(*args):
    return subprocess.run([FOLDER_TOOL, *map(str, args)], check=True, capture_output=True,
                          text=True).stdout.strip()


class StandInTier:
    """The drain and fill of MemoryTier, on host memory: files named and indexed by the tier's
    folder format; memory released only once its file is complete and still in the folder."""

    def __init__(self, mib, drain_delay, die_in_drain=False):
        block = hashlib.sha256(b"gpusnap").digest() * (1 << 15)  # 1 MiB
        self.memory = bytearray(block * mib)
        self.digest = hashlib.sha256(self.memory).hexdigest()
        self.drain_delay = drain_delay
        self.die_in_drain = die_in_drain
        self.drained = False
        self.file = None
        self.folder = None
        self.drains = self.fills = 0

    def drain(self, folder):
        try:
            name = folder_tool("drain-file", os.getpid(), 0)
            path = os.path.join(folder, name)
            with open(path, "xb") as f:
                f.write(self.memory)
            folder_tool("index", folder, os.getpid(), "GPU-standin", name)
        except subprocess.CalledProcessError as e:
            raise gpusnap_handshake.TierError(f"stand-in tier: {e.stderr.strip()}") from e
        except OSError as e:
            raise gpusnap_handshake.TierError(f"stand-in tier: {e}") from e
        if self.die_in_drain:
            # What a workload whose stray GPU work hit the drained memory does: it dies, its
            # tier's files written, without answering the pause.
            print("stand-in tier: dying in the drain", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(self.drain_delay)
        if not os.path.exists(path):
            raise gpusnap_handshake.TierError(f"stand-in tier: {path} was removed")
        self.memory, self.drained, self.file, self.folder = None, True, name, folder
        self.drains += 1

    def fill(self, folder, gpu_map):
        path = os.path.join(folder or self.folder, self.file)
        try:
            with open(path, "rb") as f:
                self.memory = bytearray(f.read())
        except OSError as e:
            raise gpusnap_handshake.TierError(f"stand-in tier: {e}") from e
        self.drained = False
        self.fills += 1


def check_memory(tier):
    if tier.drained:
        return "ERR drained"
    return "OK" if hashlib.sha256(tier.memory).hexdigest() == tier.digest else "FAIL"


def start_ranks(count, mib):
    """Forks count - 1 rank processes, each with its own stand-in tier served over a
    socketpair; returns the RankTiers that reach them."""
    ranks = []
    for _ in range(count - 1):
        mine, theirs = socket.socketpair()
        if os.fork() == 0:
            mine.close()
            for r in ranks:  # the earlier ranks' connections are not this rank's
                r._sock.close()  # noqa: SLF001
            tier = StandInTier(mib, 0)
            gpusnap_handshake.serve_rank_tier(theirs, tier, {
                "check": lambda: check_memory(tier),
                "info": lambda: {"pid": os.getpid(), "fills": tier.fills}})
            os._exit(0)
        theirs.close()
        ranks.append(gpusnap_handshake.RankTier(mine))
    return ranks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--drain-delay", type=float, default=0)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file")
    p.add_argument("--die-in-drain", action="store_true",
                   help="exit with status 1 once the drain's files are written")
    args = p.parse_args()
    tier = StandInTier(args.mib, args.drain_delay, args.die_in_drain)
    ranks = start_ranks(args.ranks, args.mib)  # before any thread starts
    group = gpusnap_handshake.TierGroup([tier] + ranks) if ranks else tier
    last = gpusnap_handshake.ResumeContext()

    def on_resume(context):
        nonlocal last
        last = context
        return True

    srv = line_server.listen(args.port)
    hs = gpusnap_handshake.Client.from_environment(memory_tier=group)
    hs.serve(lambda: True, on_resume)
    hs.ready()
    if args.ready_file:
        line_server.write_ready_file(args.ready_file, srv.getsockname()[1])

    def handle(cmd):
        if cmd == "CHECK":
            answers = [check_memory(tier)] + [r.call("check") for r in ranks]
            if not ranks:
                return answers[0]
            if all(a == "OK" for a in answers):
                return f"OK ranks={len(answers)}"
            return "FAIL " + ",".join(answers)
        if cmd == "INFO":
            text = (f"pid={os.getpid()} restored={int(last.restored)} copy={last.copy} "
                    f"tier_dir={last.tier_dir or '-'} drains={tier.drains} fills={tier.fills}")
            if ranks:
                infos = [r.call("info") for r in ranks]
                text += (f" rank_pids={','.join(str(i['pid']) for i in infos)}"
                         f" rank_fills={','.join(str(i['fills']) for i in infos)}")
            return text
        return "ERR unknown command"

    line_server.serve_lines(srv, handle)


if __name__ == "__main__":
    main()
