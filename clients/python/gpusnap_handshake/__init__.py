"""The workload's side of the gpusnap handshake, protocol version 1.

docs/handshake.md is the specification. Standard library only: `pip install clients/python`
(the package gpusnap-handshake, of gpusnap's own version), or copy this one file next to your
server as gpusnap_handshake.py.

    import gpusnap_handshake

    hs = gpusnap_handshake.Client.from_environment()   # GPUSNAP_CONTROL_DIR
    ...load weights, capture graphs...
    hs.ready()
    hs.serve(on_pause=release_kv_cache, on_resume=recreate_kv_cache)  # a background thread

on_pause() and on_resume(context) succeed unless they return False or raise (the exception's
text is the reason gpusnap reports). Without GPUSNAP_CONTROL_DIR the client is disabled
(client.enabled is False) and every call is a no-op.

The memory tier (docs/memory-tier.md): a PyTorch workload that calls

    gpusnap_handshake.use_memory_tier()    # once, before its first CUDA allocation

allocates its GPU memory through libgpusnap-tier.so, and the client then moves that memory
itself: at a pause, after on_pause(), it drains every live allocation into the folder gpusnap
names (the request's tier_dir) and releases the GPU memory, keeping every address; at a resume,
before on_resume(), it maps the memory again at the same addresses and fills it. CUDA graphs and
every tensor stay valid. Nothing else in the workload changes. A workload started by
`gpusnap run --memory-tier` needs not even that line: gpusnap's sitecustomize calls
use_memory_tier() as soon as the workload has imported torch.

Why it is built this way:
- Every message is a file, written NAME.tmp then renamed to NAME, and read by path. Nothing is
  kept open in the control directory: what the workload holds open when it is checkpointed ends
  up in the snapshot, and at restore each copy gets a different directory at the same path.
- While paused, only `resume` is read, which gpusnap writes after the capture: no descriptor
  into the directory is open when CRIU freezes the process.
- The serving thread sleeps with select() and a relative timeout, not time.sleep() or
  Event.wait(), which wait for a deadline on the monotonic clock: a restored copy may run on a
  machine whose monotonic clock is behind the source's, and a deadline taken before the
  checkpoint would then lie far in the future.
- Nothing here touches CUDA but one call at the pause, before gpusnap locks the GPU state: the
  serving thread may run later while the state is locked, and a CUDA call would then block.
- At the pause the client frees the GPU memory PyTorch keeps cached but unused (its caching
  allocator's free blocks), once on_pause has stopped the GPU work: free memory is not data,
  and whatever stays allocated is copied into the snapshot and back at every restore. The
  answer tells gpusnap how many bytes that gave back. JAX has no call that returns its
  allocator's free blocks, so a JAX workload gives back nothing here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import select
import stat
import sys
import socket
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Union

# gpusnap's version, the top-level CMakeLists.txt's project version: a client from gpusnap X
# is the one that matches a node running gpusnap X (tests/handshake/test_python_package.py
# keeps the two equal; `gpusnap version` prints the node's).
__version__ = "0.1.0"

PROTOCOL_VERSION = 1
CONTROL_DIR_VARIABLE = "GPUSNAP_CONTROL_DIR"
POLL_INTERVAL_S = 0.02  # the protocol asks for every 20-50 ms
MAX_MESSAGE_BYTES = 1 << 20
MAX_REASON_CHARS = 1000
_MAX_ANSWERED = 256


@dataclasses.dataclass
class ResumeContext:
    """What a resume tells the workload: whether it is a restored copy, which one, and how the
    GPUs and settings changed. on_resume(context) receives it."""

    restored: bool = False  # False: the source itself goes on after a capture (--leave-running)
    copy: int = 0  # this copy's index, 0..copies-1
    copies: int = 1
    artifact_id: str = ""
    gpu_map: dict[str, str] = dataclasses.field(default_factory=dict)  # old GPU uuid -> new
    settings: dict[str, str] = dataclasses.field(default_factory=dict)  # per-copy settings
    tier_dir: str = ""  # where the memory tier's files are (a copy: in the artifact); "" if none
    # where gpusnap-tier-prefill offers this copy's memory tier filled ahead; "" if nowhere
    tier_prefill_dir: str = ""


@dataclasses.dataclass
class Request:
    """A request from gpusnap, as poll() returns it: answer it by its id."""

    kind: str  # "pause" or "resume"
    id: str
    timeout_ms: int = 0  # pause: gpusnap's deadline for the answer; 0 when not given
    context: Optional[ResumeContext] = None  # resume only
    tier_dir: str = ""  # pause: the folder the memory tier drains into; "" if none


class BadRequest(ValueError):
    """A request file that does not follow the protocol; the client answers it `failed`."""


def _read_message(directory, name):
    """The bytes of DIRECTORY/NAME, or None when absent or unreadable (ENOENT included: the
    directory may be gone for a moment while it is swapped; the caller just polls again)."""
    try:
        # O_NONBLOCK: a FIFO put there by mistake must not block the poller.
        fd = os.open(os.path.join(directory, name),
                     os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MESSAGE_BYTES:
            return None
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_MESSAGE_BYTES:
                return None
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)


def _write_message(directory, name, obj):
    """Writes DIRECTORY/NAME atomically (NAME.tmp, then rename). False on any error, e.g. while
    the directory is gone; no NAME.tmp is left behind."""
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()  # ASCII: \u escapes
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # closed before the rename: nothing stays open in the directory
        os.rename(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def _string(obj, key, where=""):
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise BadRequest(f"{where}{key} is not a string")
    return value


def _string_map(ctx, key):
    value = ctx.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"context.{key} is not an object")
    for k, v in value.items():
        if not isinstance(v, str):
            # The key quoted as JSON writes it, as the C++ client names it.
            raise BadRequest(f"context.{key}[{json.dumps(k, ensure_ascii=False)}] is not a string")
    return dict(value)


def _int(obj, key, default, lo, hi, where=""):
    value = obj.get(key, default)
    # bool is an int in Python, not in JSON. The bounds are the C++ client's.
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"{where}{key} is not an integer in range")
    return value


_INT32 = (-(1 << 31), (1 << 31) - 1)


def _parse_request(kind, data):
    """A Request, or None if the message cannot be answered (not a JSON object with a string
    "id"). Raises BadRequest (with .id set) when a field has the wrong type."""
    try:
        obj = json.loads(data)
    except ValueError:  # includes UnicodeDecodeError
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not obj["id"]:
        return None
    rid = obj["id"]
    try:
        if kind == "pause":
            timeout_ms = _int(obj, "timeout_ms", 0, 0, 1 << 40)
            return Request("pause", rid, timeout_ms=timeout_ms, tier_dir=_string(obj, "tier_dir"))
        ctx = obj.get("context")
        if not isinstance(ctx, dict):
            raise BadRequest("no context object")
        restored = ctx.get("restored", False)
        if not isinstance(restored, bool):
            raise BadRequest("context.restored is not a bool")
        artifact_id = ctx.get("artifact_id", "")
        if not isinstance(artifact_id, str):
            raise BadRequest("context.artifact_id is not a string")
        context = ResumeContext(restored=restored,
                                copy=_int(ctx, "copy", 0, *_INT32, "context."),
                                copies=_int(ctx, "copies", 1, *_INT32, "context."),
                                artifact_id=artifact_id,
                                gpu_map=_string_map(ctx, "gpu_map"),
                                settings=_string_map(ctx, "settings"),
                                tier_dir=_string(ctx, "tier_dir", "context."),
                                tier_prefill_dir=_string(ctx, "tier_prefill_dir", "context."))
        return Request("resume", rid, context=context)
    except BadRequest as e:
        e.id = rid
        raise


def _short(reason):
    reason = str(reason) if reason else "unspecified"
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "..."


def release_cached_gpu_memory() -> Optional[int]:
    """Frees the GPU memory PyTorch's caching allocator holds unused, on every GPU the process
    has used, and returns the bytes given back; None when torch is not imported or never touched
    CUDA (importing or initialising it here would cost seconds and create a CUDA context)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None or not cuda.is_initialized():
        return None
    devices = range(cuda.device_count())
    before = sum(cuda.memory_reserved(d) for d in devices)
    cuda.empty_cache()
    after = sum(cuda.memory_reserved(d) for d in devices)
    return max(0, before - after)


def _resident_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_free_host_memory() -> Optional[int]:
    """Gives the C heap's free pages back to the kernel (glibc's malloc_trim(0)): memory a
    workload freed after loading (file buffers, CPU copies of weights) otherwise stays resident
    in the heap, and a capture carries it and every copy's restore re-creates it page by page.
    Returns the resident bytes given back, or None without glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    before = _resident_bytes()
    trim(0)
    after = _resident_bytes()
    if before is None or after is None:
        return None
    return max(0, before - after)


def _relative_sleep(seconds):
    # select() with a relative timeout: see the module docstring.
    select.select([], [], [], seconds)


PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


class Tier(Protocol):
    """What the client drains and fills: a MemoryTier, a TierGroup or a RankTier."""

    @property
    def drained(self) -> bool:
        """Whether the memory is drained (released, its contents in files)."""

    @property
    def live_bytes(self) -> int:
        """The bytes of GPU memory held allocated."""

    def drain(self, directory: PathLike) -> None:
        """Writes the memory into `directory` and releases it. Raises TierError."""

    def adopt(self, directory: PathLike) -> int:
        """Takes over memory a prefill filled; returns the bytes taken. Raises TierError."""

    def fill(self, directory: Optional[PathLike], gpu_map: Optional[Mapping[str, str]]) -> None:
        """Maps the memory again and fills it from `directory`. Raises TierError."""


# How long a pause waits for the GPU work in Client.gpu_work() sections to end when the request
# gives no deadline of its own.
GPU_WORK_WAIT_S = 60.0


class _Gate:
    """Sections of GPU work that a pause waits for and holds back until the resume: the memory
    tier's drain takes the GPU memory away, and a kernel still running, or launched during the
    pause, would read or write memory that is no longer there (CUDA_ERROR_ILLEGAL_ADDRESS, the
    process lost). Reentrant per thread; a thread already inside is not waited for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False
        self._depth = threading.local()

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                self._cond.wait_for(lambda: not self._closed)
                self._inside += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._inside -= 1
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Holds new sections back and waits for those running; False (and open again) when
        they did not end within `timeout` seconds."""
        own = 1 if getattr(self._depth, "n", 0) > 0 else 0
        with self._cond:
            self._closed = True
            if self._cond.wait_for(lambda: self._inside <= own, timeout):
                return True
            self._closed = False
            self._cond.notify_all()
            return False

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()


class Client:
    """The workload's handshake client. Two styles, not to be mixed on one client:

    - serve(on_pause, on_resume): a daemon thread polls and calls the callbacks (on that
      thread), in protocol order, and writes the answers.
    - poll() and answer_*(): the caller polls from its own loop (every 20-50 ms) and answers.

    One client per control directory: children inherit GPUSNAP_CONTROL_DIR, but only the process
    that coordinates the workload may speak.
    """

    def __init__(self, control_dir: Optional[str], memory_tier: Optional[Tier] = None,
                 release_cached_memory: bool = True) -> None:
        """A client for an explicit directory; disabled when it is empty/None or relative.
        memory_tier: the tier the client drains and fills (default: the one use_memory_tier()
        installed, if any).
        release_cached_memory: free PyTorch's cached free GPU blocks when answering a pause."""
        self._memory_tier = memory_tier
        control_dir = control_dir or ""
        if len(control_dir) > 1:
            control_dir = control_dir.rstrip("/") or "/"
        # Relative: disabled, as it would change meaning with the working directory.
        self._dir = control_dir if control_dir.startswith("/") else ""
        self._release_cached_memory = release_cached_memory
        self._lock = threading.RLock()
        self._paused = False  # answered `paused`, and no `resumed` since
        self._ready_wanted = False
        self._ready_written = False
        self._answered = []  # ("pause"|"resume", id), the last few
        self._outstanding = None  # (kind, id) handed out by poll() and not answered yet
        self._unsent = None  # (request name, id, answer name, body) whose write failed
        self._thread = None
        self._stop = threading.Event()
        self._gate = _Gate()

    @classmethod
    def from_environment(cls, memory_tier: Optional[Tier] = None,
                         release_cached_memory: bool = True) -> Client:
        """A client for $GPUSNAP_CONTROL_DIR; disabled when it is unset, empty or relative."""
        return cls(os.environ.get(CONTROL_DIR_VARIABLE), memory_tier, release_cached_memory)

    @property
    def enabled(self) -> bool:
        """Whether the client speaks at all (a control directory was given)."""
        return bool(self._dir)

    @property
    def control_dir(self) -> str:
        """The control directory, or "" when disabled."""
        return self._dir

    # ---- announcing ----------------------------------------------------------------------

    def ready(self) -> None:
        """Writes `ready`: the workload is initialised and capturable. Retried on every poll
        while the directory is not there."""
        if not self.enabled:
            return
        with self._lock:
            self._ready_wanted = True
            self._write_ready()

    def _write_ready(self):
        self._ready_written = _write_message(
            self._dir, "ready", {"protocol": PROTOCOL_VERSION, "pid": os.getpid()})

    # ---- GPU work and the pause -------------------------------------------------------------

    def gpu_work(self) -> contextlib.AbstractContextManager[None]:
        """A section of GPU work (a request's forward pass, a generation step): wrap it in
        `with client.gpu_work():` on every thread that launches GPU work. A pause waits for the
        sections running to end and holds new ones back until the workload resumes (a failed
        pause lets them go at once): nothing runs on the GPU while the memory tier's memory is
        away. A pause whose sections do not end within its deadline (60 s without one) fails,
        saying so. Works, and never blocks, when the client is disabled."""
        return self._gate.section()

    def _hold_gpu_work(self, request: Request) -> Optional[str]:
        """Closes the gate for a pause; the reason to fail it when the work did not end."""
        wait = request.timeout_ms / 2000.0 if request.timeout_ms else GPU_WORK_WAIT_S
        if self._gate.close(wait):
            return None
        return (f"GPU work in Client.gpu_work() sections did not end within {wait:g} s of the "
                "pause: finish in-flight requests sooner, or give the pause a longer timeout")

    # ---- the background style -------------------------------------------------------------

    def serve(self, on_pause: Callable[[], Optional[bool]],
              on_resume: Callable[[ResumeContext], Optional[bool]]) -> None:
        """Starts the serving thread and returns at once. No-op when disabled."""
        if not self.enabled:
            return
        if self._thread is not None:
            raise RuntimeError("gpusnap handshake: serve() called twice")
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve_loop, args=(on_pause, on_resume),
                                        name="gpusnap-handshake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the serving thread (from inside a callback: after that callback)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve_loop(self, on_pause, on_resume):
        while not self._stop.is_set():
            try:
                self._serve_once(on_pause, on_resume)
            except Exception:  # keep the handshake alive whatever happens
                pass
            if self._stop.is_set():
                break
            _relative_sleep(POLL_INTERVAL_S)

    def _serve_once(self, on_pause, on_resume):
        # Several requests may be waiting (a pause, then a resume): handle them in order.
        while not self._stop.is_set():
            req = self._poll()
            if req is None:
                return
            try:
                if req.kind == "pause":
                    held = self._hold_gpu_work(req)
                    if held is not None:
                        raise RuntimeError(held)
                    ok = on_pause() if on_pause else True
                    if ok is not False:
                        try:
                            self.drain_memory_tier(req)
                        except TierError:
                            # A failed pause leaves the workload as it was: undo on_pause.
                            if on_resume:
                                on_resume(ResumeContext())
                            raise
                else:
                    # The memory first: on_resume may use it, and allocates from the tier.
                    self.fill_memory_tier(req)
                    ok = on_resume(req.context) if on_resume else True
                reason = f"on_{req.kind} returned False"
            except Exception as e:  # noqa: BLE001 - any failure is reported to gpusnap
                ok, reason = False, str(e) or type(e).__name__
            if ok is False:
                self.answer_failed(req.id, reason)
            elif req.kind == "pause":
                self.answer_paused(req.id)
            else:
                self.answer_resumed(req.id)

    # ---- the memory tier ------------------------------------------------------------------

    def _tier(self):
        return self._memory_tier if self._memory_tier is not None else _installed_tier

    def drain_memory_tier(self, request: Request) -> None:
        """At a pause, after the workload released what it does not want saved: writes every
        live allocation of the memory tier into request.tier_dir, then releases the GPU memory
        (the addresses stay). Raises TierError, having released nothing, when it cannot. Does
        nothing without a tier or a tier_dir (the driver's checkpoint then carries the memory).
        serve() calls it; the polling style calls it before answer_paused()."""
        tier = self._tier()
        if tier is not None and request.tier_dir:
            tier.drain(request.tier_dir)

    def fill_memory_tier(self, request: Request) -> None:
        """At a resume, before anything uses GPU memory: maps the memory tier's memory at the
        same addresses again and fills it. Raises TierError, leaving nothing mapped, when it
        cannot (the workload stays paused; a later resume retries). serve() calls it; the
        polling style calls it first when it handles a resume."""
        tier = self._tier()
        if tier is None or not tier.drained:
            return
        # Memory a prefill made and filled while the copy was restored is taken over first;
        # whatever that does not cover (all of it, if it fails) the fill then copies itself.
        prefill = request.context.tier_prefill_dir
        if prefill and hasattr(tier, "adopt"):
            try:
                tier.adopt(prefill)
            except TierError as e:
                print(f"gpusnap handshake: the tier fills by itself: {e}", file=sys.stderr,
                      flush=True)
        tier.fill(request.context.tier_dir, request.context.gpu_map)

    # ---- the polling style ----------------------------------------------------------------

    def poll(self) -> Optional[Request]:
        """The next Request to act on, or None. While running that is a new `pause`; while
        paused, a new `resume`. The client itself ignores requests already answered and a
        `pause` while paused, answers `failed` to malformed requests, and answers `resumed` at
        once to a `resume` that finds the workload running. The same request is returned until
        it is answered."""
        if not self.enabled:
            return None
        if self._thread is not None:
            raise RuntimeError("gpusnap handshake: poll() while serving")
        req = self._poll()
        if req is not None and req.kind == "pause":
            # Handed out: GPU work is held back from here until the pause fails or the
            # workload resumes (see gpu_work()).
            held = self._hold_gpu_work(req)
            if held is not None:
                self.answer_failed(req.id, held)
                return None
        return req

    def answer_paused(self, request_id: str) -> None:
        """In-flight work done, memory released, no more GPU work until resume. Frees PyTorch's
        cached free GPU memory first and tells gpusnap how much, as "released_bytes", then gives
        the C heap's free pages back to the kernel (unless the client was made without
        release_cached_memory)."""
        if not self.enabled:
            return
        body = {"id": request_id}
        if self._release_cached_memory:
            try:
                released = release_cached_gpu_memory()
                if released is not None:
                    body["released_bytes"] = released
            except Exception:  # noqa: BLE001 - a failed release costs only artifact bytes
                pass
            release_free_host_memory()
        with self._lock:
            self._answer("pause", request_id, "paused", body)
            self._paused = True

    def answer_resumed(self, request_id: str) -> None:
        """Memory re-created, settings applied, serving again."""
        if not self.enabled:
            return
        with self._lock:
            # `ready` first: whoever sees `resumed` also sees the workload capturable again, in
            # this directory (a restored copy's directory starts empty).
            if self._ready_wanted:
                self._write_ready()
            self._answer("resume", request_id, "resumed", {"id": request_id})
            self._paused = False
        self._gate.open()

    def answer_failed(self, request_id: str, reason: object) -> None:
        """The pause or resume could not be done. After a failed pause the workload must be
        serving as before; after a failed resume it stays paused (gpusnap may resume again)."""
        if not self.enabled:
            return
        with self._lock:
            kind = "resume" if self._paused else "pause"
            if self._outstanding and self._outstanding[1] == request_id:
                kind = self._outstanding[0]
            self._answer(kind, request_id, "failed", {"id": request_id, "reason": _short(reason)})
        if kind == "pause":
            self._gate.open()  # the workload serves on as before

    # ---- internals --------------------------------------------------------------------------

    def _answer(self, kind, request_id, name, body):
        # Marked answered whether or not the write works: the workload did what was asked and
        # must not do it twice. A failed write is retried while the request is still there.
        self._answered.append((kind, request_id))
        del self._answered[:-_MAX_ANSWERED]
        if self._outstanding == (kind, request_id):
            self._outstanding = None
        if _write_message(self._dir, name, body):
            self._unsent = None
        else:
            self._unsent = (kind, request_id, name, body)

    def _retry_writes(self):
        # Not `ready` while paused: nothing but `resume` may be touched then (a capture may be
        # freezing the process).
        if self._ready_wanted and not self._ready_written and not self._paused:
            self._write_ready()
        if self._unsent is None:
            return
        kind, request_id, name, body = self._unsent
        data = _read_message(self._dir, kind)
        if data is None:
            return  # the directory may be gone for a moment: keep the answer
        try:
            req = _parse_request(kind, data)
            current = req.id if req else None
        except BadRequest as e:
            current = e.id
        if current != request_id:
            self._unsent = None  # a newer request, or none: the old answer is moot
        elif _write_message(self._dir, name, body):
            self._unsent = None

    def _next(self, kind):
        data = _read_message(self._dir, kind)
        if data is None:
            return None
        try:
            req = _parse_request(kind, data)
        except BadRequest as e:
            if (kind, e.id) not in self._answered:
                self._answer(kind, e.id, "failed", {"id": e.id, "reason": f"bad request: {e}"})
            return None
        if req is None or (kind, req.id) in self._answered:
            return None
        return req

    def _poll(self):
        with self._lock:
            self._retry_writes()
            if self._paused:
                # Only `resume`: see the module docstring.
                req = self._next("resume")
            else:
                req = self._next("pause")
                if req is None:
                    # A `resume` that finds the workload running (gpusnap gave up waiting for
                    # `paused`, or the pause failed) needs no work: answer it at once.
                    resume = self._next("resume")
                    if resume is not None:
                        self._answer("resume", resume.id, "resumed", {"id": resume.id})
            if req is not None:
                self._outstanding = (req.kind, req.id)
            return req


# ---- the memory tier ----------------------------------------------------------------------

TIER_LIBRARY_NAME = "libgpusnap-tier.so"
TIER_LIBRARY_VARIABLE = "GPUSNAP_TIER_LIBRARY"
_ERROR_BYTES = 1024
_installed_tier = None  # set once by use_memory_tier(): one allocator per process


class TierError(RuntimeError):
    """The memory tier could not drain or fill; the text says why."""


def find_tier_library() -> str:
    """The path of libgpusnap-tier.so: $GPUSNAP_TIER_LIBRARY, else beside the
    libgpusnap-preload.so that gpusnap put in LD_PRELOAD, else /opt/gpusnap/bin (a node's)."""
    named = os.environ.get(TIER_LIBRARY_VARIABLE)
    if named:
        return named
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if os.path.basename(entry) == "libgpusnap-preload.so":
            candidate = os.path.join(os.path.dirname(entry), TIER_LIBRARY_NAME)
            if os.path.exists(candidate):
                return candidate
    candidate = os.path.join("/opt/gpusnap/bin", TIER_LIBRARY_NAME)
    if os.path.exists(candidate):
        return candidate
    raise TierError(f"gpusnap memory tier: {TIER_LIBRARY_NAME} not found (set "
                    f"{TIER_LIBRARY_VARIABLE} to its path; gpusnap installs it next to "
                    "libgpusnap-preload.so)")


class MemoryTier:
    """libgpusnap-tier.so's drain and fill (clients/include/gpusnap/tier_api.h), through ctypes."""

    SERVING, DRAINED = 1, 2

    def __init__(self, path: str) -> None:
        self.path = path
        # The same path PyTorch's pluggable allocator opens: dlopen returns the same library,
        # so both reach the one tier of this process.
        self._lib = ctypes.CDLL(path)
        self._lib.gpusnap_tier_drain.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        self._lib.gpusnap_tier_fill.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                                ctypes.c_size_t]
        self._lib.gpusnap_tier_live_bytes.restype = ctypes.c_ulonglong
        self._lib.gpusnap_tier_adopt.argtypes = [ctypes.c_char_p,
                                                 ctypes.POINTER(ctypes.c_ulonglong),
                                                 ctypes.c_char_p, ctypes.c_size_t]

    @property
    def drained(self) -> bool:
        """Whether the tier's memory is drained (released, its contents in files)."""
        return bool(self._lib.gpusnap_tier_state() == self.DRAINED)

    @property
    def live_bytes(self) -> int:
        """The bytes of GPU memory the tier holds allocated."""
        return int(self._lib.gpusnap_tier_live_bytes())

    def drain(self, directory: PathLike) -> None:
        """Writes every live allocation into `directory` and releases its GPU memory, keeping
        the addresses. Raises TierError, having released nothing."""
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        if self._lib.gpusnap_tier_drain(os.fsencode(directory), error, _ERROR_BYTES) != 0:
            raise TierError(error.value.decode(errors="replace"))

    def adopt(self, directory: PathLike) -> int:
        """Takes over the memory gpusnap-tier-prefill filled for this process (offered in
        `directory`); returns the bytes taken. Raises TierError, having taken nothing."""
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        adopted = ctypes.c_ulonglong(0)
        if self._lib.gpusnap_tier_adopt(os.fsencode(directory), ctypes.byref(adopted), error,
                                        _ERROR_BYTES) != 0:
            raise TierError(error.value.decode(errors="replace"))
        return adopted.value

    def fill(self, directory: Optional[PathLike], gpu_map: Optional[Mapping[str, str]]) -> None:
        """Maps the memory again at the same addresses (on the GPUs gpu_map names for the old
        ones) and fills it from `directory`. Raises TierError."""
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        pairs = ";".join(f"{old}={new}" for old, new in (gpu_map or {}).items())
        if self._lib.gpusnap_tier_fill(os.fsencode(directory or ""), pairs.encode(), error,
                                       _ERROR_BYTES) != 0:
            raise TierError(error.value.decode(errors="replace"))


def use_memory_tier(library: Optional[str] = None) -> MemoryTier:
    """Makes PyTorch allocate its GPU memory through gpusnap's memory tier. Call it once,
    before the first CUDA allocation (PyTorch can change its allocator only before it has
    allocated). Returns the MemoryTier; the handshake client drains and fills it by itself.
    Raises TierError when the library is missing or PyTorch refuses the allocator.

    It also turns off torch.compile's CUDA graph trees, which PyTorch runs only on its own
    allocator, when Inductor is loaded (below): mode="reduce-overhead" then captures a CUDA graph
    per compiled graph, as with torch.cuda.graph."""
    global _installed_tier
    if _installed_tier is not None:
        return _installed_tier
    path = library or find_tier_library()
    try:
        import torch  # noqa: PLC0415 - only workloads that opt in need PyTorch
    except ImportError as e:
        raise TierError(f"gpusnap memory tier: PyTorch is not importable ({e}); a workload "
                        "without PyTorch allocates with tier_malloc itself") from e
    # Under `gpusnap run --memory-tier` that import may have installed the tier already (the
    # hook of gpusnap's sitecustomize runs at the end of torch's import): once per process.
    if _installed_tier is not None:
        return _installed_tier
    try:
        tier = MemoryTier(path)
    except OSError as e:
        raise TierError(f"gpusnap memory tier: cannot load {path} ({e}); set "
                        f"{TIER_LIBRARY_VARIABLE} to gpusnap's {TIER_LIBRARY_NAME}") from e
    try:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "tier_malloc", "tier_free")
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise TierError(f"gpusnap memory tier: PyTorch refused the allocator ({e}); call "
                        "use_memory_tier() before anything allocates GPU memory") from e
    _installed_tier = tier
    _turn_off_graph_trees_when_inductor_loads()
    return tier


# ---- torch.compile on the tier -------------------------------------------------------------
#
# torch.compile's CUDA graph trees (mode="reduce-overhead") keep their graphs' memory in one pool
# they inspect through PyTorch's own caching allocator (checkPoolLiveAllocations), which PyTorch
# does not offer a pluggable allocator: on the tier every compiled call would raise. Without the trees, Inductor captures each compiled graph with
# torch.cuda.graph, whose memory the tier keeps in a pool per capture like any graph's. So once
# the tier is installed the trees are turned off when Inductor's configuration is loaded: at once
# if it already is, else by a finder that waits for it, so that a workload that never compiles
# imports nothing more. A workload may still turn them back on (and then gets PyTorch's error).

_INDUCTOR_CONFIG = "torch._inductor.config"


def _turn_off_graph_trees(config):
    try:
        config.triton.cudagraph_trees = False
    except AttributeError:  # an Inductor without graph trees: nothing to turn off
        pass


class _AfterInductorConfig:
    """Inductor's configuration module's own loader, the trees turned off once its code ran."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        module.__loader__ = self._loader  # PyTorch sees its own loader, as without the finder
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _remove_inductor_finder()
        _turn_off_graph_trees(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _InductorConfigFinder:
    """A sys.meta_path finder for Inductor's configuration module alone."""

    def __init__(self):
        self._searching = set()  # threads inside find_spec: the other finders are asked

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _INDUCTOR_CONFIG or threading.get_ident() in self._searching:
            return None
        self._searching.add(threading.get_ident())
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is not self and find is not None:
                    spec = find(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._searching.discard(threading.get_ident())
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AfterInductorConfig(spec.loader)
        return spec


def _remove_inductor_finder():
    for finder in [f for f in sys.meta_path if isinstance(f, _InductorConfigFinder)]:
        try:
            sys.meta_path.remove(finder)
        except ValueError:  # another thread's import removed it
            pass


def _turn_off_graph_trees_when_inductor_loads():
    config = sys.modules.get(_INDUCTOR_CONFIG)
    if config is not None:
        _turn_off_graph_trees(config)
    else:
        _remove_inductor_finder()
        sys.meta_path.insert(0, _InductorConfigFinder())


# ---- several processes, one handshake: tensor-parallel ranks ---------------------------------

_RANK_MESSAGE_BYTES = 64 << 10  # a request or answer between a workload's own processes


class TierGroup:
    """Several memory tiers drained and filled as one, for a workload of several processes
    (tensor-parallel ranks, each with its own tier) whose one handshake client speaks for all:
    give it to the client as memory_tier. Its members are the process's own MemoryTier and a
    RankTier for every other rank. Each rank writes its own files (named by its pid) into the
    one folder gpusnap names.

    drain() drains the members in order; when one fails, those already drained are filled back
    from the same folder and TierError is raised, so that a failed pause leaves every rank with
    its memory. fill() fills every drained member and raises the first error once all were
    tried (gpusnap then refuses the copy)."""

    def __init__(self, members: list[Tier]) -> None:
        self.members = list(members)

    @property
    def drained(self) -> bool:
        """Whether any member is drained."""
        return any(m.drained for m in self.members)

    @property
    def live_bytes(self) -> int:
        """The live bytes of every member together."""
        return sum(m.live_bytes for m in self.members)

    def drain(self, directory: PathLike) -> None:
        """Drains every member in order; on a failure fills back those drained, then raises
        TierError."""
        done = []
        for m in self.members:
            try:
                m.drain(directory)
            except Exception as e:
                for d in reversed(done):
                    try:
                        d.fill(directory, {})
                    except Exception:  # noqa: BLE001 - the drain's own failure is reported
                        pass
                raise TierError(f"{e} (the ranks drained before it were filled back)") from e
            done.append(m)

    def adopt(self, directory: PathLike) -> int:
        """Every member takes over what a prefill filled for it (each rank's own socket in
        `directory`); raises TierError naming the members that could not, once all were tried:
        fill() then fills what they did not take."""
        failed, taken = [], 0
        for m in self.members:
            if m.drained and hasattr(m, "adopt"):
                try:
                    taken += m.adopt(directory) or 0
                except Exception as e:  # noqa: BLE001 - the fill does what was not taken
                    failed.append(str(e))
        if failed:
            raise TierError("; ".join(failed))
        return taken

    def fill(self, directory: Optional[PathLike], gpu_map: Optional[Mapping[str, str]]) -> None:
        """Fills every drained member; raises the first TierError once all were tried."""
        first = None
        for m in self.members:
            if not m.drained:
                continue
            try:
                m.fill(directory, gpu_map)
            except Exception as e:  # noqa: BLE001 - every rank is tried; the first error raised
                first = first or e
        if first is not None:
            raise TierError(str(first)) from first


def _send_message(sock, obj):
    data = (json.dumps(obj) + "\n").encode()
    if len(data) > _RANK_MESSAGE_BYTES:
        raise TierError("gpusnap memory tier: a rank message over 64 KiB")
    sock.sendall(data)


def _receive_message(sock, pending):
    """One JSON line from `sock`; `pending` (a bytearray) keeps what followed it. None at EOF."""
    while b"\n" not in pending:
        if len(pending) > _RANK_MESSAGE_BYTES:
            raise TierError("gpusnap memory tier: a rank message over 64 KiB")
        chunk = sock.recv(65536)
        if not chunk:
            return None
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise TierError(f"gpusnap memory tier: a malformed rank message ({e})") from e
    if not isinstance(obj, dict):
        raise TierError("gpusnap memory tier: a rank message that is not an object")
    return obj


class RankTier:
    """Another rank's memory tier, reached over a connected stream socket whose other end that
    rank serves with serve_rank_tier() (a socketpair made before the ranks start, or a TCP
    connection on loopback: CRIU restores both with the workload). call() also carries the
    workload's own requests, which serve_rank_tier() hands to its `handlers`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()
        self._lock = threading.Lock()
        self._drained = False

    def call(self, op: str, **params: Any) -> Any:
        """Asks the other rank to run `op` (a tier operation, or one of its handlers) with
        `params`; returns its result. Raises TierError with the other rank's error."""
        with self._lock:
            try:
                _send_message(self._sock, dict(params, op=op))
                answer = _receive_message(self._sock, self._pending)
            except OSError as e:
                answer = None
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    raise TierError(f"gpusnap memory tier: cannot reach the rank ({e})") from e
        if answer is None:
            raise TierError(f"gpusnap memory tier: the rank closed its connection during {op}")
        if not answer.get("ok"):
            raise TierError(str(answer.get("error") or f"the rank's {op} failed"))
        return answer.get("result")

    @property
    def drained(self) -> bool:
        """Whether this side drained the other rank's tier and has not filled it since."""
        return self._drained

    @property
    def live_bytes(self) -> int:
        """The other rank's tier's live bytes."""
        return int(self.call("live_bytes") or 0)

    def drain(self, directory: PathLike) -> None:
        """The other rank drains its tier into `directory`."""
        self.call("drain", dir=os.fsdecode(directory))
        self._drained = True

    def adopt(self, directory: PathLike) -> int:
        """The other rank takes over what a prefill filled for it; returns the bytes taken."""
        return int(self.call("adopt", dir=os.fsdecode(directory)) or 0)

    def fill(self, directory: Optional[PathLike], gpu_map: Optional[Mapping[str, str]]) -> None:
        """The other rank fills its tier from `directory`."""
        self.call("fill", dir=os.fsdecode(directory or ""), gpu_map=dict(gpu_map or {}))
        self._drained = False


def serve_rank_tier(sock: socket.socket, tier: Optional[Tier] = None,
                    handlers: Optional[Mapping[str, Callable[..., Any]]] = None) -> None:
    """A rank's side of RankTier: answers requests on `sock` until the other end closes it,
    draining and filling `tier` (default: the one use_memory_tier() installed in this process)
    and calling handlers[op](**params) for the workload's own requests. Run it in a thread of
    its own (serve_rank_tier_in_background) or as the rank's main loop."""
    handlers = dict(handlers or {})
    pending = bytearray()
    with sock:  # this loop owns its end: closed when the other end is
        while True:
            request = _receive_message(sock, pending)
            if request is None:
                return
            _answer_rank_request(sock, request, tier, handlers)


def _answer_rank_request(sock, request, tier, handlers):
    op = request.pop("op", None)
    t = tier if tier is not None else _installed_tier
    try:
        if op == "drain":
            if t is None:
                raise TierError("gpusnap memory tier: this rank has no tier")
            t.drain(request["dir"])
            result = None
        elif op == "fill":
            if t is None:
                raise TierError("gpusnap memory tier: this rank has no tier")
            t.fill(request["dir"], request.get("gpu_map") or {})
            result = None
        elif op == "adopt":
            result = t.adopt(request["dir"]) if t is not None and hasattr(t, "adopt") else 0
        elif op == "live_bytes":
            result = t.live_bytes if t is not None else 0
        elif op in handlers:
            result = handlers[op](**request)
        else:
            raise TierError(f"gpusnap memory tier: unknown rank request {op!r}")
        _send_message(sock, {"ok": True, "result": result})
    except Exception as e:  # noqa: BLE001 - every failure is answered, the loop goes on
        _send_message(sock, {"ok": False, "error": str(e) or type(e).__name__})


def serve_rank_tier_in_background(
        sock: socket.socket, tier: Optional[Tier] = None,
        handlers: Optional[Mapping[str, Callable[..., Any]]] = None) -> threading.Thread:
    """serve_rank_tier() on a daemon thread; returns the thread."""
    thread = threading.Thread(target=serve_rank_tier, args=(sock, tier, handlers), daemon=True,
                              name="gpusnap-rank-tier")
    thread.start()
    return thread
