"""The line protocol of the tests' Python workloads (torch_graph.py, torch_tier.py,
torch_tp.py, frameworks.py, tier_standin.py): a TCP listener on 127.0.0.1, the port handed over in a ready file written
atomically, and one reply line per command line. Standard library only."""

import os
import socket


def listen(port=0):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    return srv


def write_ready_file(path, port):
    with open(path + ".tmp", "w") as f:
        f.write(f"{port}\n")
    os.rename(path + ".tmp", path)


def serve_lines(srv, handle, on_quit=None):
    """Answers line commands until QUIT: handle(command) gives the reply; `on_quit` runs
    before BYE."""
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw") as io:
            for line in io:
                cmd = line.strip()
                if cmd == "QUIT":
                    if on_quit:
                        on_quit()
                    io.write("BYE\n")
                    io.flush()
                    return
                io.write(handle(cmd) + "\n")
                io.flush()


def serve(port, ready_file, commands, banner="", on_quit=None):
    """Serves until QUIT. `commands` maps a request word to a function returning the reply;
    `banner` follows "ready port=N" on stdout, printed once the workload is ready (the time to
    that point is the cold start a restore competes with)."""
    srv = listen(port)
    port = srv.getsockname()[1]
    print(f"ready port={port} {banner}".rstrip(), flush=True)
    if ready_file:
        write_ready_file(ready_file, port)

    def handle(cmd):
        handler = commands.get(cmd)
        return handler() if handler else "ERR unknown command"

    serve_lines(srv, handle, on_quit)


def add_tier_workload_arguments(parser):
    """The arguments every memory-tier test workload takes: --port (0: any), --ready-file, and
    --tier (the default) / --no-tier."""
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file")
    parser.add_argument("--tier", dest="tier", action="store_true", default=True)
    parser.add_argument("--no-tier", dest="tier", action="store_false")

