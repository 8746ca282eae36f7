"""The line protocol the GPU test workloads serve, in one place.

One request per line on TCP 127.0.0.1, one reply line each; QUIT answers BYE and ends the
server. The port goes to --ready-file (written atomically) once the workload is ready: the time
to that point is the cold start a restore competes with.
"""

import os
import socket


def serve(port, ready_file, commands, banner="", on_quit=None):
    """Serves until QUIT. `commands` maps a request word to a function returning the reply;
    `banner` follows "ready port=N" on stdout; `on_quit` runs before BYE."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    port = srv.getsockname()[1]
    print(f"ready port={port} {banner}".rstrip(), flush=True)
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        os.rename(ready_file + ".tmp", ready_file)
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
                handler = commands.get(cmd)
                io.write((handler() if handler else "ERR unknown command") + "\n")
                io.flush()
