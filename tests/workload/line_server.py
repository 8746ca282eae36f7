"""The line protocol of the tests' Python workloads (torch_graph.py, torch_tier.py,
tier_standin.py): a TCP listener on 127.0.0.1, the port handed over in a ready file written
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


def serve_lines(srv, handle):
    """Answers line commands for ever: handle(command) gives the reply; QUIT ends it."""
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw") as io:
            for line in io:
                cmd = line.strip()
                if cmd == "QUIT":
                    io.write("BYE\n")
                    io.flush()
                    return
                io.write(handle(cmd) + "\n")
                io.flush()
