#!/usr/bin/env python3
"""The agent's metrics listener (--metrics-listen): the real gpusnap-agent serves GET /metrics
on TCP without a token and nothing else (no other path, no other method, so nothing that acts),
the exposition passes `promtool check metrics`, and its families say what happened: a real
capture of the test workload with real CRIU moves the operation counters and the last success
time; the registry storage's node cache reports its size and budget. Root (the agent runs as
root alone); exits 77 ("skipped: WHY") without it."""

import os
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
        self.assertNotIn("gpusnap_node_cache_bytes", text)  # no registry storage
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

    def test_a_capture_moves_the_counters_and_the_last_success_time(self):
        if not pathlib.Path("/opt/gpusnap/criu/criu").is_file():
            self.skipTest("no CRIU in /opt/gpusnap/criu (scripts/install-criu)")
        agent = self.start()
        ready = self.dir / "ready"
        with open(self.dir / "workload.log", "w") as log:
            workload = subprocess.Popen([WORKLOAD, "--mib", "1", "--ready-file", str(ready)],
                                        stdout=log, stderr=log, start_new_session=True)
        self.addCleanup(lambda: (workload.kill(), workload.wait()))
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        before = time.time()
        status, body = agent.over_socket(
            "POST", "/v1/checkpoints", f'{{"artifact": "snap", "pid": {workload.pid}}}')
        self.assertEqual(status, 202, body)
        op = re.search(r'"id": ?"([^"]+)"', body).group(1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status, body = agent.over_socket("GET", f"/v1/operations/{op}")
            if '"state": "succeeded"' in body or '"state": "failed"' in body:
                break
            time.sleep(0.1)
        self.assertIn('"state": "succeeded"', body)
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
