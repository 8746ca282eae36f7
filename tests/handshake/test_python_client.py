"""The Python handshake client (clients/python/gpusnap_handshake/__init__.py), and the Python example worker,
against a temporary control directory, with this test playing gpusnap's side.

Plain unittest, standard library only:  python3 tests/handshake/test_python_client.py
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import gpusnap_handshake as hs  # noqa: E402

FULL_CONTEXT = {"id": "r1", "context": {
    "restored": True, "copy": 2, "copies": 4, "artifact_id": "art-7",
    "gpu_map": {"GPU-aaa": "GPU-bbb"}, "settings": {"greeting": 'hi "there"', "port": "8001"}}}


class ControlDir(unittest.TestCase):
    """A temporary control directory and gpusnap's side of the files."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="gpusnap-handshake-")
        self.dir = os.path.join(self.root, "control")
        os.mkdir(self.dir)
        self._saved_env = os.environ.get(hs.CONTROL_DIR_VARIABLE)
        os.environ[hs.CONTROL_DIR_VARIABLE] = self.dir

    def tearDown(self):
        if self._saved_env is None:
            os.environ.pop(hs.CONTROL_DIR_VARIABLE, None)
        else:
            os.environ[hs.CONTROL_DIR_VARIABLE] = self._saved_env
        shutil.rmtree(self.root, ignore_errors=True)

    def put(self, name, obj):
        tmp = os.path.join(self.dir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj))
        os.rename(tmp, os.path.join(self.dir, name))

    def get(self, name):
        try:
            with open(os.path.join(self.dir, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def remove(self, name):
        os.unlink(os.path.join(self.dir, name))

    def wait_answer(self, name, request_id, timeout=3.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answer = self.get(name)
            if answer and answer.get("id") == request_id:
                return answer
            time.sleep(0.005)
        self.fail(f"no {name} with id {request_id!r} in {os.listdir(self.dir)}")

    def assert_absent_for(self, name, seconds=0.3):
        time.sleep(seconds)
        self.assertIsNone(self.get(name), f"{name} appeared")


class Recorder:
    def __init__(self, pause_ok=True, resume_ok=True, reason=None):
        self.pauses = 0
        self.contexts = []
        self.pause_ok, self.resume_ok, self.reason = pause_ok, resume_ok, reason

    def on_pause(self):
        self.pauses += 1
        if not self.pause_ok and self.reason:
            raise RuntimeError(self.reason)
        return self.pause_ok

    def on_resume(self, context):
        self.contexts.append(context)
        if not self.resume_ok and self.reason:
            raise RuntimeError(self.reason)
        return self.resume_ok

    def serve(self, client):
        client.serve(self.on_pause, self.on_resume)
        return client


class ClientTest(ControlDir):
    def client(self):
        c = hs.Client.from_environment()
        self.addCleanup(c.stop)
        return c

    def test_no_control_dir_is_noop(self):
        del os.environ[hs.CONTROL_DIR_VARIABLE]
        c = hs.Client.from_environment()
        self.assertFalse(c.enabled)
        c.ready()
        Recorder().serve(c)
        self.assertIsNone(c.poll())
        c.answer_paused("x")
        c.answer_resumed("x")
        c.answer_failed("x", "y")
        c.stop()
        self.assertEqual(os.listdir(self.dir), [])
        os.environ[hs.CONTROL_DIR_VARIABLE] = ""
        self.assertFalse(hs.Client.from_environment().enabled)
        os.environ[hs.CONTROL_DIR_VARIABLE] = "relative/dir"
        self.assertFalse(hs.Client.from_environment().enabled)

    def test_ready_has_protocol_and_pid(self):
        c = self.client()
        self.assertTrue(c.enabled)
        self.assertEqual(c.control_dir, self.dir)
        c.ready()
        self.assertEqual(self.get("ready"), {"protocol": 1, "pid": os.getpid()})
        self.assertFalse([n for n in os.listdir(self.dir) if n.endswith(".tmp")])

    def test_ready_is_written_once_the_directory_is_there(self):
        os.rmdir(self.dir)
        c = self.client()
        c.ready()  # the directory is missing: retried by the serving thread
        Recorder().serve(c)
        time.sleep(0.1)
        os.mkdir(self.dir)
        self.assertEqual(self.wait_answer("ready", None)["protocol"], 1)

    def test_pause_is_answered_paused_with_the_same_id(self):
        rec = Recorder()
        c = rec.serve(self.client())
        c.ready()
        self.put("pause", {"id": "cap-1", "timeout_ms": 5000})
        self.assertEqual(self.wait_answer("paused", "cap-1"), {"id": "cap-1"})
        self.assertEqual(rec.pauses, 1)

    def test_pause_frees_torchs_cached_gpu_memory_and_says_how_much(self):
        # A stand-in for torch.cuda with 2 GPUs: 3 GiB reserved, 1 GiB of it cached and free.
        class Cuda:
            def __init__(self):
                self.reserved = [2 << 30, 1 << 30]
                self.cached = [1 << 30, 0]
                self.empty_cache_calls = 0

            def is_initialized(self):
                return True

            def device_count(self):
                return 2

            def memory_reserved(self, device):
                return self.reserved[device]

            def empty_cache(self):
                self.empty_cache_calls += 1
                self.reserved = [r - c for r, c in zip(self.reserved, self.cached)]
                self.cached = [0, 0]

        class Torch:
            cuda = Cuda()

        self.addCleanup(sys.modules.pop, "torch", None)
        sys.modules["torch"] = Torch
        rec = Recorder()
        rec.serve(self.client())
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.assertEqual(self.wait_answer("paused", "p1"), {"id": "p1", "released_bytes": 1 << 30})
        self.assertEqual(Torch.cuda.empty_cache_calls, 1)
        # Nothing cached any more: a second pause releases 0 bytes, and says so.
        c2 = hs.Client(self.dir)
        c2.answer_paused("p2")
        self.assertEqual(self.get("paused"), {"id": "p2", "released_bytes": 0})
        # A client made without the release leaves the cache alone.
        Torch.cuda.cached = [5, 0]
        hs.Client(self.dir, release_cached_memory=False).answer_paused("p3")
        self.assertEqual(self.get("paused"), {"id": "p3"})
        self.assertEqual(Torch.cuda.empty_cache_calls, 2)

    def test_pause_gives_the_heaps_free_pages_back_to_the_kernel(self):
        # 60 MB of the C heap freed in holes (every other 100 KB block, below glibc's mmap
        # threshold, so they stay in the heap and resident): the pause gives them back.
        blocks = [bytearray(b"x" * 100_000) for _ in range(1200)]
        del blocks[::2]
        before = hs._resident_bytes()
        hs.Client(self.dir).answer_paused("p1")
        after = hs._resident_bytes()
        self.assertEqual(self.get("paused"), {"id": "p1"})
        self.assertGreater(before - after, 30_000_000, (before, after))
        # Without the release the heap is left as it is.
        more = [bytearray(b"x" * 100_000) for _ in range(1200)]
        del more[::2]
        before = hs._resident_bytes()
        hs.Client(self.dir, release_cached_memory=False).answer_paused("p2")
        self.assertLess(before - hs._resident_bytes(), 10_000_000)
        del blocks, more

    def test_pause_touches_no_cuda_when_torch_never_initialised_it(self):
        class Cuda:
            def is_initialized(self):
                return False

            def empty_cache(self):
                raise AssertionError("empty_cache on an uninitialised CUDA")

        class Torch:
            cuda = Cuda()

        self.addCleanup(sys.modules.pop, "torch", None)
        sys.modules["torch"] = Torch
        hs.Client(self.dir).answer_paused("p1")
        self.assertEqual(self.get("paused"), {"id": "p1"})

    def test_a_pause_with_an_answered_id_is_ignored(self):
        rec = Recorder()
        rec.serve(self.client())
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.wait_answer("paused", "p1")
        self.remove("pause")
        self.remove("paused")
        self.put("resume", {"id": "r1", "context": {"restored": False, "copy": 0, "copies": 1}})
        self.wait_answer("resumed", "r1")
        self.remove("resume")
        self.remove("resumed")
        # The same pause again (a stale file): never answered twice.
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.assert_absent_for("paused")
        self.assertEqual(rec.pauses, 1)
        # A new id is a new request.
        self.put("pause", {"id": "p2", "timeout_ms": 5000})
        self.wait_answer("paused", "p2")
        self.assertEqual(rec.pauses, 2)

    def test_failed_with_reason_when_on_pause_returns_false(self):
        rec = Recorder(pause_ok=False)
        rec.serve(self.client())
        self.put("pause", {"id": "p1", "timeout_ms": 100})
        answer = self.wait_answer("failed", "p1")
        self.assertEqual(answer["reason"], "on_pause returned False")
        self.assertIsNone(self.get("paused"))
        # A failed pause leaves the workload running: the next pause is handled again.
        rec.pause_ok = True
        self.put("pause", {"id": "p2"})
        self.wait_answer("paused", "p2")
        self.assertEqual(rec.pauses, 2)

    def test_an_exception_is_a_failure_with_its_text(self):
        reason = 'busy: "batch" in flight\n\\ok \u00e9'
        rec = Recorder(pause_ok=False, reason=reason)
        rec.serve(self.client())
        self.put("pause", {"id": "p1"})
        self.assertEqual(self.wait_answer("failed", "p1")["reason"], reason)

    def test_resume_context_is_parsed_and_answered(self):
        rec = Recorder()
        c = rec.serve(self.client())
        c.ready()
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.wait_answer("paused", "p1")
        self.remove("ready")  # to see it written again
        self.put("resume", FULL_CONTEXT)
        self.assertEqual(self.wait_answer("resumed", "r1"), {"id": "r1"})
        self.assertIsNotNone(self.get("ready"))  # capturable again
        self.assertEqual(rec.contexts, [hs.ResumeContext(
            restored=True, copy=2, copies=4, artifact_id="art-7",
            gpu_map={"GPU-aaa": "GPU-bbb"}, settings={"greeting": 'hi "there"', "port": "8001"})])

    def test_a_failed_resume_stays_paused_and_may_be_retried(self):
        rec = Recorder(resume_ok=False, reason="no memory")
        rec.serve(self.client())
        self.put("pause", {"id": "p1"})
        self.wait_answer("paused", "p1")
        self.put("resume", {"id": "r1", "context": {"restored": False}})
        self.assertEqual(self.wait_answer("failed", "r1")["reason"], "no memory")
        rec.resume_ok = True
        self.put("resume", {"id": "r2", "context": {"restored": False}})
        self.wait_answer("resumed", "r2")
        self.assertEqual((rec.pauses, len(rec.contexts)), (1, 2))

    def test_control_dir_removed_and_recreated_mid_wait(self):
        rec = Recorder()
        c = rec.serve(self.client())
        c.ready()
        # Gone while the workload waits for a pause: it keeps polling.
        shutil.rmtree(self.dir)
        time.sleep(0.15)
        os.mkdir(self.dir)
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.wait_answer("paused", "p1")
        # A restore: the paused workload finds a fresh directory at the same path, here with a
        # stale copy of the pause it already answered, which must not be answered again.
        shutil.rmtree(self.dir)
        time.sleep(0.15)
        os.mkdir(self.dir)
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.put("resume", FULL_CONTEXT)
        self.wait_answer("resumed", "r1")
        self.assertIsNone(self.get("paused"))
        self.assertIsNotNone(self.get("ready"))
        self.assertEqual((rec.pauses, len(rec.contexts)), (1, 1))

    def test_poll_style(self):
        c = self.client()
        c.ready()
        self.assertIsNone(c.poll())
        self.put("pause", {"id": "p1", "timeout_ms": 1234})
        req = c.poll()
        self.assertEqual((req.kind, req.id, req.timeout_ms), ("pause", "p1", 1234))
        self.assertEqual(c.poll(), req)  # handed out again until answered
        c.answer_paused("p1")
        self.wait_answer("paused", "p1")
        self.assertIsNone(c.poll())  # the pause file is still there: already answered
        self.put("resume", FULL_CONTEXT)
        req = c.poll()
        self.assertEqual((req.kind, req.id, req.context.copy), ("resume", "r1", 2))
        self.assertEqual(req.context.settings["port"], "8001")
        c.answer_resumed("r1")
        self.wait_answer("resumed", "r1")
        self.assertIsNone(c.poll())
        self.put("pause", {"id": "p2"})
        self.assertEqual(c.poll().id, "p2")
        c.answer_failed("p2", "not now")
        self.assertEqual(self.wait_answer("failed", "p2")["reason"], "not now")
        self.assertIsNone(c.poll())

    def test_a_resume_that_finds_the_workload_running_is_answered_at_once(self):
        c = self.client()
        self.put("resume", {"id": "r9", "context": {"restored": False}})
        self.assertIsNone(c.poll())
        self.wait_answer("resumed", "r9")

    def test_malformed_requests(self):
        c = self.client()
        # Not JSON, or no id: cannot be answered, ignored.
        self.put("pause", '{"id":"p1"')
        self.assertIsNone(c.poll())
        self.put("pause", {"timeout_ms": 5})
        self.assertIsNone(c.poll())
        self.assertIsNone(self.get("failed"))
        # An id but a bad field: answered failed, once.
        self.put("pause", {"id": "p2", "timeout_ms": "soon"})
        self.assertIsNone(c.poll())
        self.assertTrue(self.wait_answer("failed", "p2")["reason"].startswith("bad request: "))
        self.remove("failed")
        self.assertIsNone(c.poll())
        self.assertIsNone(self.get("failed"))
        self.remove("pause")
        self.put("pause", {"id": "p3"})
        self.assertIsNotNone(c.poll())
        c.answer_paused("p3")
        self.put("resume", {"id": "r1", "context": {"settings": {"n": 1}}})
        self.assertIsNone(c.poll())
        self.assertIn("settings", self.wait_answer("failed", "r1")["reason"])
        self.put("resume", {"id": "r2", "context": {"copy": True}})
        self.assertIsNone(c.poll())
        self.wait_answer("failed", "r2")
        self.put("resume", {"id": "r3"})
        self.assertIsNone(c.poll())
        self.wait_answer("failed", "r3")
        # Still paused: a good resume is handed out; unknown fields are ignored.
        self.put("resume", {"id": "r4", "context": {}, "extra": [1, {"x": None}]})
        req = c.poll()
        self.assertEqual((req.id, req.context), ("r4", hs.ResumeContext()))

    def test_serve_twice_or_poll_while_serving_is_an_error(self):
        c = Recorder().serve(self.client())
        with self.assertRaises(RuntimeError):
            Recorder().serve(c)
        with self.assertRaises(RuntimeError):
            c.poll()

    def test_stop_from_inside_a_callback(self):
        c = self.client()
        calls = []

        def on_pause():
            calls.append(1)
            c.stop()

        c.serve(on_pause, lambda ctx: True)
        self.put("pause", {"id": "p1"})
        self.wait_answer("paused", "p1")
        self.put("resume", {"id": "r1", "context": {}})
        self.assert_absent_for("resumed", 0.15)
        self.assertEqual(calls, [1])

    def test_long_reasons_are_cut(self):
        c = self.client()
        self.put("pause", {"id": "p1"})
        c.poll()
        c.answer_failed("p1", "r" * 5000)
        self.assertEqual(len(self.wait_answer("failed", "p1")["reason"]), hs.MAX_REASON_CHARS + 3)


class ExampleWorkerTest(ControlDir):
    """examples/handshake_worker.py end to end: pause releases the cache, resume re-creates it
    and applies the settings, the counter survives."""

    def start_worker(self, *args, env=None):
        ready_file = os.path.join(self.root, "port")
        full_env = dict(os.environ, **(env or {}))
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "handshake_worker.py"),
             "--ready-file", ready_file, "--cache-mib", "8", *args],
            env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: (proc.kill(), proc.wait()))
        deadline = time.monotonic() + 10
        while not os.path.exists(ready_file):
            self.assertIsNone(proc.poll(), "worker exited")
            self.assertLess(time.monotonic(), deadline, "worker not ready")
            time.sleep(0.01)
        with open(ready_file) as f:
            return proc, int(f.read())

    @staticmethod
    def ask(port, line):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(line.encode() + b"\n")
            return s.makefile().readline().strip()

    def test_pause_and_resume(self):
        _, port = self.start_worker()
        self.assertEqual(self.ask(port, "PING"), "PONG")
        self.assertEqual(self.ask(port, "INCR"), "1")
        info = self.ask(port, "INFO")
        self.assertRegex(info, r"^pid=\d+ copy=-1 restored=0 cache_mib=8 greeting=-$")
        self.assertEqual(self.get("ready")["protocol"], 1)
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.wait_answer("paused", "p1")
        self.assertIn("cache_mib=0", self.ask(port, "INFO"))
        self.put("resume", {"id": "r1", "context": {
            "restored": True, "copy": 1, "copies": 2, "artifact_id": "a",
            "gpu_map": {}, "settings": {"greeting": "hola"}}})
        self.wait_answer("resumed", "r1")
        self.assertRegex(self.ask(port, "INFO"), r"copy=1 restored=1 cache_mib=8 greeting=hola$")
        self.assertEqual(self.ask(port, "HELLO"), "hola")
        self.assertEqual(self.ask(port, "INCR"), "2")
        self.assertEqual(self.ask(port, "CHECK"), "OK")

    def test_pause_refused(self):
        self.start_worker(env={"GPUSNAP_EXAMPLE_PAUSE": "fail"})
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.assertEqual(self.wait_answer("failed", "p1")["reason"], "refused by test")

    def test_pause_dies(self):
        proc, _ = self.start_worker(env={"GPUSNAP_EXAMPLE_PAUSE": "die"})
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        self.assertEqual(proc.wait(timeout=5), 3)
        self.assertIsNone(self.get("paused"))

    def test_never_ready(self):
        _, port = self.start_worker(env={"GPUSNAP_EXAMPLE_NEVER_READY": "1"})
        self.assertEqual(self.ask(port, "PING"), "PONG")
        self.assertIsNone(self.get("ready"))


class RecordingTier:
    """Stands in for the GPU side of libgpusnap-tier.so (MemoryTier): records what the client
    asks of it, in order with the workload's callbacks, and fails when told to."""

    def __init__(self, log, drain_error=None, fill_error=None):
        self.log, self.drain_error, self.fill_error = log, drain_error, fill_error
        self.drained = False

    def drain(self, directory):
        self.log.append(("drain", directory))
        if self.drain_error:
            raise hs.TierError(self.drain_error)
        self.drained = True

    def fill(self, directory, gpu_map):
        self.log.append(("fill", directory, dict(gpu_map)))
        if self.fill_error:
            raise hs.TierError(self.fill_error)
        self.drained = False


class MemoryTierClientTest(ControlDir):
    def serve(self, tier, log):
        c = hs.Client.from_environment(memory_tier=tier)
        self.addCleanup(c.stop)
        c.serve(lambda: log.append(("on_pause",)) or True,
                lambda ctx: log.append(("on_resume", ctx.restored, ctx.tier_dir)) or True)
        return c

    def test_drain_after_on_pause_and_fill_before_on_resume(self):
        log = []
        self.serve(RecordingTier(log), log)
        self.put("pause", {"id": "p1", "timeout_ms": 5000, "tier_dir": "/staging/tier"})
        self.wait_answer("paused", "p1")
        self.put("resume", {"id": "r1", "context": {
            "restored": True, "gpu_map": {"GPU-a": "GPU-b"}, "tier_dir": "/artifact/tier"}})
        self.wait_answer("resumed", "r1")
        self.assertEqual(log, [("on_pause",), ("drain", "/staging/tier"),
                               ("fill", "/artifact/tier", {"GPU-a": "GPU-b"}),
                               ("on_resume", True, "/artifact/tier")])

    def resume_with_a_prefill(self, adopt_error):
        class AdoptingTier(RecordingTier):
            def adopt(self, directory):
                self.log.append(("adopt", directory))
                if adopt_error:
                    raise hs.TierError(adopt_error)
                return 1 << 20

        log = []
        self.serve(AdoptingTier(log), log)
        self.put("pause", {"id": "p1", "tier_dir": "/staging/tier"})
        self.wait_answer("paused", "p1")
        self.put("resume", {"id": "r1", "context": {
            "restored": True, "tier_dir": "/artifact/tier",
            "tier_prefill_dir": "/run/gpusnap/prefill/copy-0"}})
        self.wait_answer("resumed", "r1")
        # Taken over or not, the fill runs (it copies what is left) and the copy resumes.
        self.assertEqual(log, [("on_pause",), ("drain", "/staging/tier"),
                               ("adopt", "/run/gpusnap/prefill/copy-0"),
                               ("fill", "/artifact/tier", {}),
                               ("on_resume", True, "/artifact/tier")])

    def test_a_prefill_is_taken_over_before_the_fill(self):
        self.resume_with_a_prefill(None)

    def test_a_prefill_that_fails_is_only_said_and_the_fill_does_it_all(self):
        self.resume_with_a_prefill("the prefill's memory is on device 1")

    def test_a_pause_waits_for_gpu_work_and_holds_it_back_until_the_resume(self):
        log = []
        c = self.serve(RecordingTier(log), log)
        started, release = threading.Event(), threading.Event()

        def request_in_flight():
            with c.gpu_work():
                started.set()
                release.wait(5)
                log.append(("request done",))

        threading.Thread(target=request_in_flight, daemon=True).start()
        self.assertTrue(started.wait(2))
        self.put("pause", {"id": "p1", "timeout_ms": 20000, "tier_dir": "/staging/tier"})
        time.sleep(0.3)
        self.assertEqual(log, [])  # the drain waits for the request in flight
        release.set()
        self.wait_answer("paused", "p1")
        # A request that comes during the pause waits for the resume.
        def request_during_pause():
            with c.gpu_work():
                log.append(("late request",))

        late = threading.Thread(target=request_during_pause, daemon=True)
        late.start()
        time.sleep(0.3)
        self.assertNotIn(("late request",), log)
        self.put("resume", {"id": "r1", "context": {"restored": True, "tier_dir": "/a/tier"}})
        self.wait_answer("resumed", "r1")
        late.join(2)
        self.assertEqual(log, [("request done",), ("on_pause",), ("drain", "/staging/tier"),
                               ("fill", "/a/tier", {}), ("on_resume", True, "/a/tier"),
                               ("late request",)])

    def test_gpu_work_that_does_not_end_fails_the_pause_and_serving_goes_on(self):
        log = []
        c = self.serve(RecordingTier(log), log)
        started, release = threading.Event(), threading.Event()

        def stuck():
            with c.gpu_work():
                started.set()
                release.wait(10)

        threading.Thread(target=stuck, daemon=True).start()
        self.assertTrue(started.wait(2))
        self.put("pause", {"id": "p1", "timeout_ms": 1000, "tier_dir": "/t"})
        reason = self.wait_answer("failed", "p1")["reason"]
        self.assertIn("did not end within 0.5 s of the pause", reason)
        self.assertEqual(log, [])  # neither on_pause nor the drain ran
        with c.gpu_work():  # open again: the workload serves on
            log.append(("next request",))
        release.set()
        self.assertEqual(log, [("next request",)])

    def test_the_polling_style_holds_gpu_work_from_the_pause_it_hands_out(self):
        c = hs.Client.from_environment()
        self.put("pause", {"id": "p1", "timeout_ms": 5000})
        req = c.poll()
        self.assertEqual(req.kind, "pause")
        entered = threading.Event()

        def request():
            with c.gpu_work():
                entered.set()

        t = threading.Thread(target=request, daemon=True)
        t.start()
        self.assertFalse(entered.wait(0.3))
        c.answer_paused(req.id)
        self.assertFalse(entered.wait(0.2))
        self.put("resume", {"id": "r1", "context": {"restored": False}})
        res = c.poll()
        c.answer_resumed(res.id)
        self.assertTrue(entered.wait(2))

    def test_a_pause_without_tier_dir_drains_nothing(self):
        log = []
        self.serve(RecordingTier(log), log)
        self.put("pause", {"id": "p1"})
        self.wait_answer("paused", "p1")
        self.put("resume", {"id": "r1", "context": {"restored": False}})
        self.wait_answer("resumed", "r1")
        self.assertEqual(log, [("on_pause",), ("on_resume", False, "")])

    def test_a_failed_drain_undoes_on_pause_and_answers_failed(self):
        log = []
        self.serve(RecordingTier(log, drain_error="memory tier: cannot write /x: No space left"), log)
        self.put("pause", {"id": "p1", "tier_dir": "/x"})
        self.assertEqual(self.wait_answer("failed", "p1")["reason"],
                         "memory tier: cannot write /x: No space left")
        self.assertEqual(log, [("on_pause",), ("drain", "/x"), ("on_resume", False, "")])
        self.assertIsNone(self.get("paused"))

    def test_a_failed_fill_answers_failed_stays_paused_and_a_new_resume_retries(self):
        log = []
        tier = RecordingTier(log, fill_error="memory tier: out of GPU memory")
        self.serve(tier, log)
        self.put("pause", {"id": "p1", "tier_dir": "/t"})
        self.wait_answer("paused", "p1")
        self.put("resume", {"id": "r1", "context": {"restored": True, "tier_dir": "/a/tier"}})
        self.assertEqual(self.wait_answer("failed", "r1")["reason"], "memory tier: out of GPU memory")
        self.assertNotIn(("on_resume", True, "/a/tier"), log)  # never on memory not filled
        tier.fill_error = None
        self.put("resume", {"id": "r2", "context": {"restored": True, "tier_dir": "/a/tier"}})
        self.wait_answer("resumed", "r2")
        self.assertEqual(log[-2:], [("fill", "/a/tier", {}), ("on_resume", True, "/a/tier")])

    def test_a_tier_dir_of_the_wrong_type_is_a_bad_request(self):
        log = []
        self.serve(RecordingTier(log), log)
        self.put("pause", {"id": "p1", "tier_dir": 7})
        self.assertEqual(self.wait_answer("failed", "p1")["reason"],
                         "bad request: tier_dir is not a string")
        self.assertEqual(log, [])


class MemoryTierLibraryTest(unittest.TestCase):
    def test_the_library_is_found_beside_the_preload_library(self):
        root = tempfile.mkdtemp(prefix="gpusnap-tier-")
        self.addCleanup(shutil.rmtree, root, True)
        for name in ("libgpusnap-preload.so", "libgpusnap-tier.so"):
            open(os.path.join(root, name), "w").close()
        saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", hs.TIER_LIBRARY_VARIABLE)}
        self.addCleanup(lambda: [os.environ.pop(k, None) if v is None else
                                 os.environ.__setitem__(k, v) for k, v in saved.items()])
        os.environ.pop(hs.TIER_LIBRARY_VARIABLE, None)
        os.environ["LD_PRELOAD"] = "/lib/other.so " + os.path.join(root, "libgpusnap-preload.so")
        self.assertEqual(hs.find_tier_library(), os.path.join(root, "libgpusnap-tier.so"))
        os.environ[hs.TIER_LIBRARY_VARIABLE] = "/elsewhere/libgpusnap-tier.so"
        self.assertEqual(hs.find_tier_library(), "/elsewhere/libgpusnap-tier.so")

    def test_the_built_library_reports_a_missing_driver_through_ctypes(self):
        path = os.environ.get("GPUSNAP_TIER_BUILT")
        if not path:
            self.skipTest("skipped: GPUSNAP_TIER_BUILT names no built library")
        if os.path.exists("/dev/nvidiactl"):
            self.skipTest("skipped: this host has the NVIDIA driver")
        tier = hs.MemoryTier(path)
        self.assertFalse(tier.drained)
        self.assertEqual(tier.live_bytes, 0)
        tier.drain(tempfile.gettempdir())  # nothing allocated: nothing to drain
        with self.assertRaises(hs.TierError) as e:
            tier.fill("", {"GPU-a": ""})
        self.assertEqual(str(e.exception), 'memory tier: bad GPU map entry "GPU-a="')


class RankTierTest(unittest.TestCase):
    """TierGroup and RankTier: several processes' tiers drained and filled as one (here the
    ranks are threads serving socketpairs, as forked ranks serve theirs)."""

    def rank(self, tier, handlers=None):
        mine, theirs = socket.socketpair()
        self.addCleanup(mine.close)
        hs.serve_rank_tier_in_background(theirs, tier, handlers)
        return hs.RankTier(mine)

    def test_every_rank_drains_and_fills_in_order_with_the_gpu_map(self):
        log = []
        group = hs.TierGroup([RecordingTier(log), self.rank(RecordingTier(log))])
        group.drain("/t")
        self.assertTrue(group.drained)
        group.fill("/t", {"GPU-a": "GPU-b"})
        self.assertFalse(group.drained)
        self.assertEqual(log, [("drain", "/t"), ("drain", "/t"), ("fill", "/t", {"GPU-a": "GPU-b"}),
                               ("fill", "/t", {"GPU-a": "GPU-b"})])

    def test_a_rank_that_fails_its_drain_has_the_ranks_before_it_filled_back(self):
        log = []
        first, last = RecordingTier(log), RecordingTier(log, drain_error="no room")
        group = hs.TierGroup([first, self.rank(RecordingTier(log)), self.rank(last)])
        with self.assertRaises(hs.TierError) as e:
            group.drain("/t")
        self.assertIn("no room", str(e.exception))
        self.assertEqual(log, [("drain", "/t"), ("drain", "/t"), ("drain", "/t"),
                               ("fill", "/t", {}), ("fill", "/t", {})])
        self.assertFalse(group.drained)

    def test_every_rank_takes_over_its_prefill_and_one_that_cannot_is_named(self):
        class AdoptingTier(RecordingTier):
            def __init__(self, log, name, error=None):
                super().__init__(log)
                self.name, self.error = name, error

            def adopt(self, directory):
                self.log.append(("adopt", self.name, directory))
                if self.error:
                    raise hs.TierError(self.error)
                return 2

        log = []
        group = hs.TierGroup([AdoptingTier(log, "rank 0"),
                              self.rank(AdoptingTier(log, "rank 1", "no prefill for rank 1")),
                              self.rank(AdoptingTier(log, "rank 2"))])
        group.drain("/t")
        with self.assertRaises(hs.TierError) as e:
            group.adopt("/p")
        self.assertIn("no prefill for rank 1", str(e.exception))
        self.assertEqual([entry for entry in log if entry[0] == "adopt"],
                         [("adopt", "rank 0", "/p"), ("adopt", "rank 1", "/p"),
                          ("adopt", "rank 2", "/p")])
        group.fill("/t", {})  # fills what was not taken (here: every member records its fill)
        self.assertFalse(group.drained)

    def test_a_failed_fill_is_raised_after_every_rank_was_tried(self):
        log = []
        group = hs.TierGroup([RecordingTier(log, fill_error="bad file"),
                              self.rank(RecordingTier(log))])
        group.drain("/t")
        with self.assertRaises(hs.TierError) as e:
            group.fill("/t", {})
        self.assertIn("bad file", str(e.exception))
        self.assertEqual([entry[0] for entry in log], ["drain", "drain", "fill", "fill"])

    def test_workload_requests_unknown_requests_and_a_closed_rank(self):
        r = self.rank(RecordingTier([]), {"check": lambda: "OK", "add": lambda a, b: a + b})
        self.assertEqual(r.call("check"), "OK")
        self.assertEqual(r.call("add", a=2, b=3), 5)
        with self.assertRaises(hs.TierError) as e:
            r.call("nonsense")
        self.assertIn("unknown rank request", str(e.exception))
        self.assertEqual(r.call("check"), "OK")  # an error answered, the rank serves on
        mine, theirs = socket.socketpair()
        theirs.close()
        with self.assertRaises(hs.TierError) as e:
            hs.RankTier(mine).call("check")
        mine.close()
        self.assertIn("closed its connection", str(e.exception))

    def test_an_oversized_or_malformed_message_is_refused(self):
        mine, theirs = socket.socketpair()
        self.addCleanup(mine.close)
        self.addCleanup(theirs.close)
        theirs.sendall(b"x" * (70 << 10))
        with self.assertRaises(hs.TierError) as e:
            hs.serve_rank_tier(mine, RecordingTier([]))
        self.assertIn("over 64 KiB", str(e.exception))
        a, b = socket.socketpair()
        self.addCleanup(a.close)
        b.sendall(b"[1]\n")
        b.close()
        with self.assertRaises(hs.TierError) as e:
            hs.serve_rank_tier(a, RecordingTier([]))
        self.assertIn("not an object", str(e.exception))


class RequestCorpus(unittest.TestCase):
    """tests/handshake/requests: each NAME.pause or NAME.resume is a message gpusnap may write,
    NAME.answer what the client makes of it. The C++ client reads the same files
    (request_corpus_test.cc), so the two clients answer every one of them alike."""

    def test_every_request_gets_its_answer(self):
        folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requests")
        names = sorted(n for n in os.listdir(folder) if n.endswith((".pause", ".resume")))
        self.assertGreater(len(names), 20)
        for name in names:
            with self.subTest(name):
                with open(os.path.join(folder, name), "rb") as f:
                    data = f.read()
                with open(os.path.join(folder, os.path.splitext(name)[0] + ".answer")) as f:
                    expected = json.load(f)
                self.assertEqual(self._answer(os.path.splitext(name)[1][1:], data), expected)

    @staticmethod
    def _answer(kind, data):
        try:
            req = hs._parse_request(kind, data)
        except hs.BadRequest as e:
            return {"failed": str(e)}
        if req is None:
            return {"ignored": True}
        if kind == "pause":
            return {"pause": {"id": req.id, "timeout_ms": req.timeout_ms,
                              "tier_dir": req.tier_dir}}
        c = req.context
        return {"resume": {"id": req.id, "restored": c.restored, "copy": c.copy,
                           "copies": c.copies, "artifact_id": c.artifact_id,
                           "gpu_map": c.gpu_map, "settings": c.settings,
                           "tier_dir": c.tier_dir, "tier_prefill_dir": c.tier_prefill_dir}}


if __name__ == "__main__":
    unittest.main()
