#!/usr/bin/env python3
"""A PyTorch worker whose KV cache stays out of gpusnap's artifact (docs/handshake.md).

A model server's KV cache is tens of GB of GPU memory that is worthless in a snapshot. This
worker shows how to leave it out while keeping the CUDA graphs that read it:

- The cache (--kv-gib GiB, fp16) is made with the CUDA driver's virtual memory management API
  through cuda-python (`cuda.bindings.driver`, or the older `cuda.cuda` layout): an address
  range is reserved once (cuMemAddressReserve) and backed by physical memory (cuMemCreate,
  cuMemMap, cuMemSetAccess). PyTorch sees it as a tensor through __cuda_array_interface__;
  PyTorch's allocator never owns it.
- It loads weights (--weights-gib GiB of bf16 matrices, made in place on the GPU) and captures
  a CUDA graph whose answer reads rows spread over the whole cache, so a wrong cache gives a
  wrong answer. The answer with the cache filled with a fixed pattern is computed once, before
  any checkpoint, and kept.
- It speaks the handshake (clients/python/gpusnap_handshake/__init__.py). On `pause` it synchronizes, unmaps
  and releases the physical memory and keeps the address reservation (the graph holds those
  addresses). On `resume` it maps fresh physical memory at the same addresses, fills in the
  pattern again and answers `resumed`. The artifact therefore holds the weights and the graph,
  not the cache.

    python3 examples/kv_cache_worker.py [--kv-gib 8] [--weights-gib 1] [--dim 8192]
                                        [--port N] [--ready-file PATH] [--keep-kv-on-pause]

--kv-gib 0 gives the smallest cache (one allocation granule, 2 MiB on an H200), so that the
graph is the same with and without a real cache. --keep-kv-on-pause is the control: the cache
stays mapped through the pause, so it is captured like any other GPU memory.
--free-address-on-pause is a fallback, not the recommended way: it also frees the address
range on pause and asks for the same range again (by address) on resume.

Line protocol on TCP 127.0.0.1:PORT, one reply line per command:
  PING  -> PONG
  CHECK -> OK max_err=0 replays=<n> pid=<pid> kv_addr=0x<address>  (replays the graph and
           compares with the answer computed before any checkpoint) or FAIL max_err=<e> ...
  PROBE -> OK wrong_kv_err=<e> max_err=0: zeroes the cache and replays (the answer must
           change), then fills the pattern in again and replays (it must be exact again)
  INFO  -> pid=... kv_bytes=... kv_addr=... mapped=<0|1> copy=... restored=... resumes=...
           map_s=... fill_s=... (the last resume's costs) and the start-up timings
  QUIT  -> BYE, then the worker exits
While paused, commands other than PING and INFO answer "ERR paused".

--ready-file PATH receives the port (atomically) once the worker is initialised and serving.
"""

import argparse
import os
import socket
import sys
import threading
import time

T0 = time.monotonic()

_HERE = os.path.dirname(os.path.abspath(__file__))
for _dir in (os.path.join(_HERE, "..", "clients", "python"), _HERE):  # the repository, or a copy beside
    if os.path.exists(os.path.join(_dir, "gpusnap_handshake")) or os.path.exists(
            os.path.join(_dir, "gpusnap_handshake.py")):
        sys.path.insert(0, _dir)
        break
import gpusnap_handshake  # noqa: E402

GIB = 1 << 30
PATTERN_MOD = 997  # kv[r, c] = ((r % 997) * 131 + 7 * c) % 997: exact in fp16, differs by row
SAMPLE_ROWS = 64  # rows of the cache the graph reads, spread evenly over all of it
BATCH = 16  # rows of the input; each output row reads SAMPLE_ROWS / BATCH cache rows
FILL_CHUNK_BYTES = 256 << 20  # int32 temporaries per step while filling the pattern


def import_driver():
    """cuda-python's driver module: `cuda.bindings.driver`, or `cuda.cuda` in older releases."""
    try:
        from cuda.bindings import driver
        return driver, "cuda.bindings.driver"
    except ImportError:
        from cuda import cuda as driver
        return driver, "cuda.cuda"


def round_up(n, multiple):
    return (n + multiple - 1) // multiple * multiple


class CudaError(RuntimeError):
    pass


class Driver:
    """Calls into cuda-python's driver module; raises CudaError naming the call and the error."""

    def __init__(self):
        self.cu, self.module = import_driver()

    def __call__(self, name, *args):
        result = getattr(self.cu, name)(*args)
        if not isinstance(result, tuple):
            result = (result,)
        if result[0] != self.cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"{name} failed: {self.error_name(result[0])}")
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def error_name(self, err):
        try:
            status, name = self.cu.cuGetErrorName(err)
            if status == self.cu.CUresult.CUDA_SUCCESS and name:
                return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001 - only for the message
            pass
        return repr(err)


class _CudaArray:
    """A view of device memory that torch.as_tensor accepts (CUDA Array Interface v2)."""

    def __init__(self, address, shape, typestr):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (address, False), "strides": None,
                                         "version": 2}


class VmmRegion:
    """Device memory at an address that never changes: the range is reserved once and for
    ever; physical memory is mapped into it and released from it as often as needed."""

    def __init__(self, drv, device_ordinal, nbytes):
        cu = drv.cu
        self.drv = drv
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device_ordinal
        self.prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.access = cu.CUmemAccessDesc()
        self.access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = device_ordinal
        self.access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.granularity = int(drv(
            "cuMemGetAllocationGranularity", self.prop,
            cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.size = round_up(max(int(nbytes), 1), self.granularity)
        power_of_two = self.granularity & (self.granularity - 1) == 0
        self.alignment = self.granularity if power_of_two else 0
        self.address = int(drv("cuMemAddressReserve", self.size, self.alignment, 0, 0))
        self.reserved = True
        self.handle = None  # the physical memory while mapped

    @property
    def mapped(self):
        return self.handle is not None

    def map(self):
        """Fresh physical memory at self.address (contents undefined)."""
        handle = self.drv("cuMemCreate", self.size, self.prop, 0)
        try:
            self.drv("cuMemMap", self.address, self.size, 0, handle, 0)
        except Exception:
            self.drv.cu.cuMemRelease(handle)
            raise
        try:
            self.drv("cuMemSetAccess", self.address, self.size, [self.access], 1)
        except Exception:
            self.drv.cu.cuMemUnmap(self.address, self.size)
            self.drv.cu.cuMemRelease(handle)
            raise
        self.handle = handle

    def unmap(self):
        """Gives the physical memory back; the address range stays reserved."""
        self.drv("cuMemUnmap", self.address, self.size)
        handle, self.handle = self.handle, None
        self.drv("cuMemRelease", handle)

    def free_address(self):
        """Fallback only (--free-address-on-pause): gives the address range back too."""
        self.drv("cuMemAddressFree", self.address, self.size)
        self.reserved = False

    def reserve_again(self):
        """Fallback only: the same range again, asked for by address (a hint the driver may
        ignore: then the graph's addresses are lost, and this fails)."""
        got = int(self.drv("cuMemAddressReserve", self.size, self.alignment, self.address, 0))
        if got != self.address:
            self.drv.cu.cuMemAddressFree(got, self.size)
            raise CudaError(f"cuMemAddressReserve returned 0x{got:x}, not the graph's "
                            f"0x{self.address:x}")
        self.reserved = True

    def cuda_array(self, shape, typestr):
        return _CudaArray(self.address, shape, typestr)


class Worker:
    def __init__(self, args):
        import torch  # timed: part of the cold start

        self.torch = torch
        self.timings = {"import_s": time.monotonic() - T0}
        self.lock = threading.Lock()  # one command at a time; a pause waits for it
        self.connections = set()
        self.keep_kv = args.keep_kv_on_pause
        self.free_reservation = args.free_address_on_pause
        self.paused = False
        self.replays = 0
        self.copy, self.restored, self.resumes = -1, False, 0
        self.last_resume = {"map_s": 0.0, "fill_s": 0.0}
        self.release_s = 0.0

        t = time.monotonic()
        torch.cuda.init()
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.zeros(1, device=self.device)  # the primary context exists and is current here
        self.drv = Driver()
        self.drv("cuInit", 0)
        cu_device = self.drv("cuDeviceGet", self.device.index)
        # PyTorch's context (the device's primary context): made current on every thread that
        # calls the driver, the handshake's included.
        self.context = self.drv("cuDevicePrimaryCtxRetain", cu_device)
        self.timings["cuda_init_s"] = time.monotonic() - t

        t = time.monotonic()
        self.dim = args.dim
        self.kv_region = VmmRegion(self.drv, self.device.index, args.kv_gib * GIB)
        self.kv_region.map()
        rows = self.kv_region.size // (self.dim * 2)
        if rows < 1:
            raise SystemExit(f"--dim {self.dim} is too wide for a {self.kv_region.size}-byte cache")
        self.kv = torch.as_tensor(self.kv_region.cuda_array((rows, self.dim), "<f2"),
                                  device=self.device)
        if (self.kv.data_ptr() != self.kv_region.address or self.kv.dtype != torch.float16
                or tuple(self.kv.shape) != (rows, self.dim)):
            raise SystemExit(f"torch.as_tensor did not wrap the cache in place: "
                             f"data_ptr=0x{self.kv.data_ptr():x} "
                             f"address=0x{self.kv_region.address:x} {self.kv.dtype} "
                             f"{tuple(self.kv.shape)}")
        self.sample = torch.tensor(
            [i * (rows - 1) // (SAMPLE_ROWS - 1) for i in range(SAMPLE_ROWS)],
            dtype=torch.int64, device=self.device)
        self.fill()
        self.timings["kv_s"] = time.monotonic() - t

        t = time.monotonic()
        layers = max(1, int(args.weights_gib * GIB / (self.dim * self.dim * 2)))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(1234)
        self.weights = []
        for _ in range(layers):
            w = torch.randn(self.dim, self.dim, device=self.device, generator=gen)
            self.weights.append((w / self.dim**0.5).to(torch.bfloat16))
            del w
        gen.manual_seed(7)
        self.x = torch.randn(BATCH, self.dim, device=self.device, generator=gen).to(torch.bfloat16)
        torch.cuda.synchronize(self.device)
        self.timings["weights_s"] = time.monotonic() - t

        t = time.monotonic()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.forward()
        self.graph.replay()
        torch.cuda.synchronize(self.device)
        self.reference = self.out.cpu().clone()
        torch.cuda.empty_cache()  # the fill's temporaries: not in the artifact
        self.timings["graph_s"] = time.monotonic() - t
        self.layers = layers
        self.timings["ready_s"] = time.monotonic() - T0

    def forward(self):
        torch = self.torch
        h = self.x
        for w in self.weights:
            h = torch.tanh(h @ w)
        rows = self.kv.index_select(0, self.sample).float()  # reads all over the cache
        kv_term = rows.view(BATCH, SAMPLE_ROWS // BATCH, self.dim).sum(1) * 1e-3
        return h.float() + kv_term

    def fill(self):
        """The cache's deterministic content (a server would start with an empty cache; this
        pattern lets CHECK tell a right cache from a wrong one)."""
        torch = self.torch
        rows = self.kv.shape[0]
        col_term = torch.arange(self.dim, dtype=torch.int32, device=self.device) * 7
        step = max(1, FILL_CHUNK_BYTES // (self.dim * 4))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            row_term = (torch.arange(r0, r1, dtype=torch.int32, device=self.device)
                        % PATTERN_MOD) * 131
            self.kv[r0:r1].copy_((row_term[:, None] + col_term[None, :]) % PATTERN_MOD)
        torch.cuda.synchronize(self.device)

    def use_cuda_here(self):
        """Every thread that calls CUDA: PyTorch's device, and its context for the driver."""
        self.torch.cuda.set_device(self.device)
        self.drv("cuCtxSetCurrent", self.context)

    def replay_error(self):
        self.graph.replay()
        self.torch.cuda.synchronize(self.device)
        self.replays += 1
        return (self.out.cpu() - self.reference).abs().max().item()

    # ---- the handshake (called on the handshake client's thread) ------------------------------

    def on_pause(self):
        with self.lock:  # the command in progress finishes first
            self.use_cuda_here()
            self.torch.cuda.synchronize(self.device)  # nothing in flight reads the cache
            t = time.monotonic()
            if not self.keep_kv:
                self.kv_region.unmap()  # the graph keeps its addresses: still reserved
                if self.free_reservation:
                    self.kv_region.free_address()
            self.torch.cuda.empty_cache()
            self.release_s = time.monotonic() - t
            self.paused = True
            # A copy lives in a fresh network namespace: no client connection can follow it.
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        print(f"handshake: paused, cache {'kept' if self.keep_kv else 'released'} "
              f"({self.kv_region.size} bytes at 0x{self.kv_region.address:x}, "
              f"{self.release_s:.3f} s)", file=sys.stderr, flush=True)

    def on_resume(self, ctx):
        with self.lock:
            self.use_cuda_here()
            t = time.monotonic()
            remapped = not self.kv_region.mapped
            if remapped:
                if not self.kv_region.reserved:
                    self.kv_region.reserve_again()
                self.kv_region.map()  # the same addresses: the graph is valid again
            t_map = time.monotonic()
            if remapped:
                self.fill()
            t_fill = time.monotonic()
            self.last_resume = {"map_s": t_map - t, "fill_s": t_fill - t_map}
            self.copy, self.restored = ctx.copy, ctx.restored
            self.resumes += 1
            self.paused = False
        print(f"handshake: resumed copy={ctx.copy}/{ctx.copies} restored={ctx.restored} "
              f"cache {'re-mapped' if remapped else 'kept'} at 0x{self.kv_region.address:x} "
              f"(map {self.last_resume['map_s']:.3f} s, fill {self.last_resume['fill_s']:.3f} s)",
              file=sys.stderr, flush=True)

    # ---- the line protocol --------------------------------------------------------------------

    def info(self):
        t = self.timings
        return (f"pid={os.getpid()} device={self.torch.cuda.get_device_name(self.device)} "
                f"driver_module={self.drv.module} kv_bytes={self.kv_region.size} "
                f"kv_addr=0x{self.kv_region.address:x} granularity={self.kv_region.granularity} "
                f"mapped={int(self.kv_region.mapped)} keep_kv={int(self.keep_kv)} "
                f"free_address={int(self.free_reservation)} "
                f"layers={self.layers} dim={self.dim} copy={self.copy} "
                f"restored={int(self.restored)} resumes={self.resumes} "
                f"map_s={self.last_resume['map_s']:.4f} fill_s={self.last_resume['fill_s']:.4f} "
                f"release_s={self.release_s:.4f} ready_s={t['ready_s']:.2f} "
                f"import_s={t['import_s']:.2f} kv_s={t['kv_s']:.2f} "
                f"weights_s={t['weights_s']:.2f} graph_s={t['graph_s']:.2f}")

    def command(self, cmd):
        with self.lock:
            if cmd == "PING":
                return "PONG"
            if cmd == "INFO":
                return self.info()
            if self.paused:
                return "ERR paused"
            if cmd == "CHECK":
                self.use_cuda_here()
                err = self.replay_error()
                return (f"{'OK' if err == 0 else 'FAIL'} max_err={err:g} replays={self.replays} "
                        f"pid={os.getpid()} kv_addr=0x{self.kv_region.address:x}")
            if cmd == "PROBE":
                self.use_cuda_here()
                self.kv.zero_()
                wrong = self.replay_error()
                self.fill()
                right = self.replay_error()
                ok = wrong > 0 and right == 0
                return f"{'OK' if ok else 'FAIL'} wrong_kv_err={wrong:g} max_err={right:g}"
            return "ERR unknown command"

    def handle(self, conn):
        with self.lock:
            self.connections.add(conn)
        try:
            with conn.makefile("r", encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    cmd = line.strip()
                    if cmd == "QUIT":
                        conn.sendall(b"BYE\n")
                        os._exit(0)
                    try:
                        reply = self.command(cmd)
                    except Exception as e:  # noqa: BLE001 - the client sees what failed
                        reply = f"ERR {type(e).__name__}: {e}"
                    conn.sendall((reply + "\n").encode())
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="A PyTorch worker whose KV cache (CUDA VMM memory) "
                                            "is released while gpusnap captures it.")
    p.add_argument("--kv-gib", type=float, default=8.0,
                   help="KV cache size in GiB (0: one allocation granule)")
    p.add_argument("--weights-gib", type=float, default=1.0, help="bf16 weights in GiB")
    p.add_argument("--dim", type=int, default=8192, help="model width (and cache row length)")
    p.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any)")
    p.add_argument("--ready-file", help="write the port here once serving")
    p.add_argument("--keep-kv-on-pause", action="store_true",
                   help="control: keep the cache mapped through the pause (it is then captured)")
    p.add_argument("--free-address-on-pause", action="store_true",
                   help="fallback: also free the address range on pause and ask for the same "
                        "range again on resume (for a driver that cannot carry a reservation)")
    args = p.parse_args(argv)
    if args.kv_gib < 0 or args.weights_gib <= 0 or args.dim < 1:
        p.error("sizes must be positive (--kv-gib may be 0)")
    return args


def main():
    args = parse_args()
    worker = Worker(args)
    server = socket.create_server(("127.0.0.1", args.port))
    port = server.getsockname()[1]

    handshake = gpusnap_handshake.Client.from_environment()  # disabled without gpusnap
    handshake.serve(worker.on_pause, worker.on_resume)
    handshake.ready()  # initialised, the answer computed: capturable from now on
    print(f"ready port={port} pid={os.getpid()} handshake={'on' if handshake.enabled else 'off'} "
          f"{worker.info()}", flush=True)
    if args.ready_file:
        write_atomically(args.ready_file, f"{port}\n")

    while True:
        conn, _ = server.accept()
        threading.Thread(target=worker.handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
