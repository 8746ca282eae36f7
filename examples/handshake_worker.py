#!/usr/bin/env python3
"""A small server that speaks the gpusnap handshake (docs/handshake.md).

It holds a "cache" (a buffer of --cache-mib MiB standing for a GPU KV cache: big, and worthless
in a snapshot) and state that must survive (a counter). On pause it finishes the command in
progress, frees the cache and drops its client connections; on resume it makes a new cache and
applies the per-copy settings ("greeting", "cache_mib").

    python3 examples/handshake_worker.py [--port N] [--cache-mib N] [--ready-file PATH]

Line protocol on 127.0.0.1:PORT, one reply line per command:
    PING -> PONG        INCR -> the counter        HELLO -> the greeting        CHECK -> OK
    INFO -> pid=<pid> copy=<copy or -1> restored=<0|1> cache_mib=<N, 0 while released>
            greeting=<greeting or ->
While paused, commands other than PING and INFO answer "ERR paused".

For tests: GPUSNAP_EXAMPLE_PAUSE=fail refuses to pause, GPUSNAP_EXAMPLE_PAUSE=die exits 3 on
pause, GPUSNAP_EXAMPLE_NEVER_READY=1 never writes `ready`.
"""

import argparse
import gc
import os
import socket
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
import gpusnap_handshake  # noqa: E402


class Worker:
    def __init__(self, cache_mib):
        self.lock = threading.Lock()  # one command at a time; a pause waits for it
        self.cache_mib = cache_mib
        self.cache = None
        self.counter = 0  # the state a snapshot must carry
        self.copy, self.restored, self.greeting = -1, False, None
        self.paused = False
        self.connections = set()
        self.make_cache()

    def make_cache(self):
        self.cache = bytearray(b"k") * (self.cache_mib << 20)  # written: really in memory

    def on_pause(self):
        mode = os.environ.get("GPUSNAP_EXAMPLE_PAUSE")
        if mode == "die":
            os._exit(3)
        if mode == "fail":
            raise RuntimeError("refused by test")  # becomes the reason of `failed`
        with self.lock:  # the command in progress finishes first
            self.paused = True
            self.cache = None  # not in the snapshot, not in any copy
            gc.collect()
            # A copy lives in a fresh network namespace: no client connection can follow it.
            for conn in self.connections:
                conn.shutdown(socket.SHUT_RDWR)
        print("handshake: paused, cache released", file=sys.stderr, flush=True)

    def on_resume(self, ctx):
        mib = ctx.settings.get("cache_mib", str(self.cache_mib))
        if not mib.isdigit() or int(mib) > 1 << 16:
            raise ValueError(f"bad cache_mib setting {mib!r}")
        with self.lock:
            self.cache_mib = int(mib)
            self.make_cache()
            self.greeting = ctx.settings.get("greeting", self.greeting)
            self.copy, self.restored = ctx.copy, ctx.restored
            self.paused = False
        print(f"handshake: resumed copy={ctx.copy}/{ctx.copies} restored={ctx.restored}",
              file=sys.stderr, flush=True)

    def command(self, cmd):
        with self.lock:
            if cmd == "PING":
                return "PONG"
            if cmd == "INFO":
                cache_mib = len(self.cache) >> 20 if self.cache is not None else 0
                return (f"pid={os.getpid()} copy={self.copy} restored={int(self.restored)} "
                        f"cache_mib={cache_mib} greeting={self.greeting or '-'}")
            if self.paused:
                return "ERR paused"
            if cmd == "INCR":
                self.counter += 1
                return str(self.counter)
            if cmd == "HELLO":
                return self.greeting or "hello"
            if cmd == "CHECK":
                ok = self.cache.count(b"k") == len(self.cache) == self.cache_mib << 20
                return "OK" if ok else "FAIL cache"
            return "ERR unknown command"

    def handle(self, conn):
        with self.lock:
            self.connections.add(conn)
        try:
            for line in conn.makefile("r", encoding="utf-8", errors="replace"):
                conn.sendall((self.command(line.strip()) + "\n").encode())
        except OSError:
            pass
        finally:
            with self.lock:
                self.connections.discard(conn)
            conn.close()


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser(description="A server that speaks the gpusnap handshake.")
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any)")
    parser.add_argument("--cache-mib", type=int, default=64, help="size of the cache in MiB")
    parser.add_argument("--ready-file", help="write the port here once serving")
    args = parser.parse_args()

    worker = Worker(args.cache_mib)
    server = socket.create_server(("127.0.0.1", args.port))
    port = server.getsockname()[1]

    handshake = gpusnap_handshake.Client.from_environment()  # disabled without gpusnap
    handshake.serve(worker.on_pause, worker.on_resume)
    if os.environ.get("GPUSNAP_EXAMPLE_NEVER_READY") != "1":
        handshake.ready()  # initialised: capturable from now on
    print(f"ready port={port} pid={os.getpid()} handshake={'on' if handshake.enabled else 'off'}",
          flush=True)
    if args.ready_file:
        write_atomically(args.ready_file, f"{port}\n")

    while True:
        conn, _ = server.accept()
        threading.Thread(target=worker.handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
