#!/usr/bin/env python3
"""The agent's metrics listener (--metrics-listen): the real gpusnap-agent serves GET /metrics
on TCP without a token and nothing else (no other path, no other method, so nothing that acts),
the exposition passes `promtool check metrics`, and its families say what happened: a real
capture of the test workload with real CRIU moves the operation counters and the last success
time; the registry storage's node cache reports its size and budget; captures pushed to a real
docker-registry and prefetched back move the registry's byte and chunk counters and the node
cache's hits and misses by what moved. Root (the agent runs as root alone); exits 77
("skipped: WHY") without it."""

import os
import json
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

AGENT = os.environ.get("GPUSNAP_AGENT", "")
WORKLOAD = os.environ.get("GPUSNAP_WORKLOAD", "")
VERSION = os.environ.get("GPUSNAP_VERSION", "")


def blocker():
    if os.geteuid() != 0:
        return "not root"
    if not (AGENT and WORKLOAD and VERSION):
        return "GPUSNAP_AGENT, GPUSNAP_WORKLOAD and GPUSNAP_VERSION unset (ctest sets them)"
    return None


def samples(text):
    """{'name{labels}': value} of the exposition's samples."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """A real docker-registry on 127.0.0.1, plain HTTP, its storage and log in `dir`."""

    def __init__(self, dir):
        self.port = free_port()
        dir.mkdir()
        (dir / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {dir / 'storage'}\nhttp:\n  addr: 127.0.0.1:{self.port}\n"
            "  secret: gpusnap-test\n")
        self.log = dir / "registry.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(["docker-registry", "serve", str(dir / "config.yml")],
                                            stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"docker-registry did not start: {self.log.read_text()}")
                time.sleep(0.05)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)


class AgentProcess:
    """A real gpusnap-agent in `dir`, with `extra` flags; its stderr in dir/agent.log."""

    def __init__(self, dir, extra=()):
        self.dir = dir
        self.socket = dir / "agent.sock"
        self.log = dir / "agent.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [AGENT, "--socket", str(self.socket), "--storage", str(dir / "snapshots"),
                 "--state-dir", str(dir / "state"), "--run-dir", str(dir / "run"), *extra],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 30
        while "serving" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the agent did not start: {self.log.read_text()}")
            time.sleep(0.05)
        m = re.search(r"metrics on [^:]+:(\d+)", self.log.read_text())
        self.port = int(m.group(1)) if m else None

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)

    def over_socket(self, method, path, body=None):
        """(status, body) of one request on the agent's socket."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            data = body.encode() if body else b""
            head = (f"{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
            s.sendall(head.encode() + data)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head, _, payload = raw.partition(b"\r\n\r\n")
        return int(head.split()[1]), payload.decode()


class MetricsListenerTest(unittest.TestCase):
    def setUp(self):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="gpusnap-metrics-"))
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def start(self, extra=("--metrics-listen", "127.0.0.1:0")):
        agent = AgentProcess(self.dir, extra)
        self.addCleanup(agent.stop)
        return agent

    def get(self, agent, path, method="GET"):
        request = urllib.request.Request(f"http://127.0.0.1:{agent.port}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, r.headers.get("Content-Type"), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type"), e.read().decode()

    def check_with_promtool(self, text):
        if shutil.which("promtool") is None:
            return  # the families are checked below all the same; promtool adds the linting
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                           text=True)
        self.assertEqual((r.returncode, r.stdout + r.stderr), (0, ""))

    def test_off_by_default(self):
        agent = self.start(extra=())
        self.assertIsNone(agent.port)
        self.assertNotIn("metrics on", agent.log.read_text())

    def test_metrics_alone_without_a_token(self):
        agent = self.start()
        status, content_type, text = self.get(agent, "/metrics")
        self.assertEqual(status, 200)
        self.assertEqual(content_type, "text/plain; version=0.0.4; charset=utf-8")
        self.check_with_promtool(text)
        s = samples(text)
        self.assertEqual(s[f'gpusnap_build_info{{version="{VERSION}"}}'], 1)
        self.assertEqual(s["gpusnap_operations_queued"], 0)
        self.assertEqual(s['gpusnap_operations_in_flight{kind="checkpoint"}'], 0)
        self.assertGreater(s["process_resident_memory_bytes"], 0)
        self.assertGreater(s["process_open_fds"], 0)
        self.assertLess(abs(s["process_start_time_seconds"] - time.time()), 120)
        self.assertNotIn("gpusnap_node_cache_", text)  # no registry storage
        self.assertNotIn("gpusnap_registry_", text)
        # The same exposition on the socket.
        status, body = agent.over_socket("GET", "/metrics")
        self.assertEqual(status, 200)
        self.assertEqual(set(samples(body)), set(s))
        # Nothing else: no other path, no other method; the API stays on the socket.
        for path in ("/v1/healthz", "/v1/operations", "/v1/snapshots", "/"):
            self.assertEqual(self.get(agent, path)[0], 404, path)
        for method, path in (("POST", "/v1/checkpoints"), ("POST", "/metrics"),
                             ("DELETE", "/metrics"), ("PUT", "/v1/restores")):
            status, _, body = self.get(agent, path, method)
            self.assertEqual(status, 405, (method, path))
            self.assertEqual(body, "read-only: GET /metrics\n")
        self.assertTrue(list((self.dir / "snapshots").iterdir()) == [])

    def workload(self, mib):
        """The test workload, ready; killed at the test's end."""
        if not pathlib.Path("/opt/gpusnap/criu/criu").is_file():
            self.skipTest("no CRIU in /opt/gpusnap/criu (scripts/install-criu)")
        ready = self.dir / "ready"
        with open(self.dir / "workload.log", "w") as log:
            workload = subprocess.Popen([WORKLOAD, "--mib", str(mib), "--ready-file", str(ready)],
                                        stdout=log, stderr=log, start_new_session=True)
        self.addCleanup(lambda: (workload.kill(), workload.wait()))
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return workload

    def run_operation(self, agent, path, request):
        """The operation document of one request, polled on the socket until it ended."""
        status, body = agent.over_socket("POST", path, json.dumps(request))
        self.assertEqual(status, 202, body)
        op = json.loads(body)["operation"]["id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status, body = agent.over_socket("GET", f"/v1/operations/{op}")
            doc = json.loads(body)
            doc = doc.get("operation", doc)
            if doc["state"] in ("succeeded", "failed"):
                return doc
            time.sleep(0.1)
        self.fail(f"{path} {request} did not end: {body}")

    def test_a_capture_moves_the_counters_and_the_last_success_time(self):
        workload = self.workload(1)
        agent = self.start()
        before = time.time()
        op = self.run_operation(agent, "/v1/checkpoints", {"artifact": "snap", "pid": workload.pid})
        self.assertEqual(op["state"], "succeeded", op)
        _, _, text = self.get(agent, "/metrics")
        self.check_with_promtool(text)
        s = samples(text)
        self.assertEqual(s['gpusnap_operations_total{kind="checkpoint",result="succeeded"}'], 1)
        self.assertIn('gpusnap_last_success_timestamp_seconds{kind="checkpoint"}', s, text)
        at = s['gpusnap_last_success_timestamp_seconds{kind="checkpoint"}']
        self.assertGreaterEqual(at, int(before))
        self.assertLessEqual(at, time.time() + 1)
        self.assertNotIn('gpusnap_last_success_timestamp_seconds{kind="restore"}', s)

    def test_node_cache_size_against_its_budget(self):
        cache = self.dir / "cache"
        agent = self.start(extra=("--metrics-listen", "127.0.0.1:0", "--registry",
                                  "oci://127.0.0.1:9/gpusnap/snapshots", "--cache", str(cache),
                                  "--cache-budget-mib", "3"))
        _, _, text = self.get(agent, "/metrics")
        self.check_with_promtool(text)
        s = samples(text)
        self.assertEqual(s["gpusnap_node_cache_budget_bytes"], 3 << 20)
        on_disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        self.assertEqual(s["gpusnap_node_cache_bytes"], on_disk)
        # A file put there (as a pull would) is counted on the next scrape.
        cache.mkdir(exist_ok=True)
        (cache / "probe").write_bytes(b"x" * 12345)
        _, _, text = self.get(agent, "/metrics")
        self.assertEqual(samples(text)["gpusnap_node_cache_bytes"], on_disk + 12345)

    def test_pushes_and_pulls_move_the_registry_and_node_cache_counters(self):
        if shutil.which("docker-registry") is None:
            self.skipTest("docker-registry is not installed (scripts/install-deps)")
        workload = self.workload(4)
        registry = Registry(self.dir / "registry")
        self.addCleanup(registry.stop)
        agent = self.start(extra=(
            "--metrics-listen", "127.0.0.1:0", "--registry",
            f"oci://127.0.0.1:{registry.port}/gpusnap/snapshots", "--registry-plain-http",
            "--cache", str(self.dir / "cache")))

        def scrape():
            _, _, text = self.get(agent, "/metrics")
            self.check_with_promtool(text)
            return samples(text)

        pull = 'gpusnap_registry_{}_total{{direction="pull"}}'
        push = 'gpusnap_registry_{}_total{{direction="push"}}'
        s = scrape()
        for name in (pull.format("bytes"), pull.format("chunks"), push.format("bytes"),
                     push.format("chunks"), "gpusnap_node_cache_hits_total",
                     "gpusnap_node_cache_misses_total", "gpusnap_node_cache_hit_bytes_total",
                     "gpusnap_node_cache_evictions_total"):
            self.assertEqual(s[name], 0, name)

        # Two captures of one workload, each pushed: the second shares most chunks with the
        # first, which the registry holds already and which are not uploaded again.
        pushed = []
        for name in ("first", "second"):
            op = self.run_operation(agent, "/v1/checkpoints",
                                    {"artifact": name, "pid": workload.pid})
            self.assertEqual(op["state"], "succeeded", op)
            pushed.append(op["result"]["pushed"])
        s = scrape()
        self.assertGreater(pushed[0]["chunks_uploaded"], 0)
        self.assertEqual(s[push.format("chunks")], sum(p["chunks_uploaded"] for p in pushed))
        self.assertEqual(s[push.format("bytes")], sum(p["bytes_uploaded"] for p in pushed))
        self.assertLess(pushed[1]["chunks_uploaded"], pushed[1]["chunks"])
        self.assertEqual(s[pull.format("chunks")], 0)

        # The first prefetched into the empty node cache: every chunk fetched, each of the
        # chunks the first push uploaded, byte for byte.
        op = self.run_operation(agent, "/v1/prefetch", {"reference": pushed[0]["reference"]})
        self.assertEqual(op["state"], "succeeded", op)
        s = scrape()
        self.assertEqual(s[pull.format("chunks")], pushed[0]["chunks_uploaded"])
        self.assertEqual(s[pull.format("bytes")], pushed[0]["bytes_uploaded"])
        self.assertEqual(s["gpusnap_node_cache_misses_total"], pushed[0]["chunks_uploaded"])
        self.assertEqual(s["gpusnap_node_cache_hits_total"], 0)

        # The second: what it shares with the first is found on the node, the rest fetched.
        op = self.run_operation(agent, "/v1/prefetch", {"reference": pushed[1]["reference"]})
        self.assertEqual(op["state"], "succeeded", op)
        second = op["result"]
        s = scrape()
        self.assertGreater(second["chunks_from_cache"], 0, second)
        self.assertEqual(s["gpusnap_node_cache_hits_total"], second["chunks_from_cache"])
        self.assertEqual(s["gpusnap_node_cache_hit_bytes_total"], second["bytes_from_cache"])
        self.assertEqual(s["gpusnap_node_cache_misses_total"],
                         pushed[0]["chunks_uploaded"] + second["chunks_fetched"])
        self.assertEqual(s[pull.format("bytes")],
                         pushed[0]["bytes_uploaded"] + second["bytes_fetched"])
        self.assertEqual(s["gpusnap_node_cache_evictions_total"], 0)  # the default budget
        # The cache's size is what its budget counts: its chunks, and the node copies under
        # RUN_DIR/pulled that hold the uncompressed ones in their place (blocks allocated).
        chunks = sum(p.stat().st_size for p in (self.dir / "cache").rglob("*") if p.is_file())
        copies = sum(p.stat().st_blocks * 512 for p in (self.dir / "run" / "pulled").rglob("*")
                     if p.is_file() and not p.is_symlink())
        self.assertGreater(copies, 0)
        self.assertEqual(s["gpusnap_node_cache_bytes"], chunks + copies)
        # A prefetch of a snapshot whose node copy is here fetches nothing and finds no chunk.
        op = self.run_operation(agent, "/v1/prefetch", {"reference": pushed[1]["reference"]})
        self.assertEqual(op["state"], "succeeded", op)
        self.assertFalse(op["result"]["pulled"])
        again = scrape()
        for name in (pull.format("chunks"), "gpusnap_node_cache_hits_total",
                     "gpusnap_node_cache_misses_total"):
            self.assertEqual(again[name], s[name], name)

    def test_a_port_in_use_is_refused_by_name(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            r = subprocess.run([AGENT, "--socket", str(self.dir / "a.sock"), "--storage",
                                str(self.dir / "snapshots"), "--state-dir", str(self.dir / "state"),
                                "--run-dir", str(self.dir / "run"),
                                "--metrics-listen", f"127.0.0.1:{port}"],
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"cannot listen for metrics on 127.0.0.1:{port}", r.stderr)
        r = subprocess.run([AGENT, "--metrics-listen", "9464"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("bad --metrics-listen '9464': use ADDR:PORT, e.g. 0.0.0.0:9464", r.stderr)


if __name__ == "__main__":
    why = blocker()
    if why:
        print(f"skipped: {why}")
        sys.exit(77)
    unittest.main()
