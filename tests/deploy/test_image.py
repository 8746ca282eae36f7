#!/usr/bin/env python3
"""The container image (scripts/build-image), built from this build and run with real runc:
the OCI layout is unpacked by umoci (an independent OCI implementation, which checks every
blob's digest) into a runc bundle, and the commands deploy/'s DaemonSet gives each container
run in it -- the agent's and the controller's programs, the init container's install command
into a host directory, the agent's probes against a real agent -- as well as gpusnap and CRIU from the image.
Root, runc and umoci; exits 77 ("skipped: WHY") where one is missing."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest

import yaml

ROOT = pathlib.Path(os.environ.get("GPUSNAP_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
BUILD = pathlib.Path(os.environ.get("GPUSNAP_BUILD_DIR", ROOT / "build"))
VERSION = os.environ.get("GPUSNAP_VERSION", "0.1.0")
CRIU_PREFIX = pathlib.Path("/opt/gpusnap/criu")


def blocker():
    if os.geteuid() != 0:
        return "not root"
    for tool, package in (("runc", "runc"), ("umoci", "umoci")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    if not (CRIU_PREFIX / "criu").is_file():
        return f"no CRIU prefix at {CRIU_PREFIX} (scripts/install-criu)"
    return None


def daemonset():
    with open(ROOT / "deploy/manifests/gpusnap.yaml") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return next(d for d in docs if d["kind"] == "DaemonSet")


class ImageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = pathlib.Path(tempfile.mkdtemp(prefix="gpusnap-image-"))
        cls.output = cls.dir / "image"
        built = subprocess.run([str(ROOT / "scripts/build-image"), "--build", str(BUILD),
                                "--output", str(cls.output)], capture_output=True, text=True)
        if built.returncode != 0:
            raise AssertionError(f"scripts/build-image failed: {built.stderr}")
        cls.built = built.stdout
        cls.index = json.loads((cls.output / "oci/index.json").read_text())
        cls.bundle = cls.dir / "bundle"
        unpacked = subprocess.run(["umoci", "unpack", "--image", f"{cls.output}/oci:{VERSION}",
                                   str(cls.bundle)], capture_output=True, text=True)
        if unpacked.returncode != 0:
            raise AssertionError(f"umoci unpack failed: {unpacked.stderr}")
        cls.config = json.loads((cls.bundle / "config.json").read_text())
        cls.runs = 0

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_in_image(self, args, mounts=(), readonly=False):
        """Runs `args` as a container of the image (runc run, no terminal); (exit code, output)."""
        config = json.loads(json.dumps(self.config))
        config["process"]["args"] = args
        config["process"]["terminal"] = False
        config["root"]["readonly"] = readonly
        for source, destination in mounts:
            config["mounts"].append({"destination": destination, "type": "bind",
                                     "source": str(source), "options": ["rbind", "rw"]})
        (self.bundle / "config.json").write_text(json.dumps(config))
        type(self).runs += 1
        r = subprocess.run(["runc", "--root", str(self.dir / "runc"), "run", "--bundle",
                            str(self.bundle), f"gpusnap-image-test-{os.getpid()}-{self.runs}"],
                           capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout + r.stderr

    def test_the_image_is_named_as_the_deployment_names_it(self):
        ds = daemonset()
        images = {c["image"] for c in ds["spec"]["template"]["spec"]["containers"] +
                  ds["spec"]["template"]["spec"]["initContainers"]}
        self.assertEqual(images, {f"registry.example.com/gpusnap:{VERSION}"})
        annotations = self.index["manifests"][0]["annotations"]
        self.assertEqual(annotations["io.containerd.image.name"], images.pop())
        self.assertEqual(annotations["org.opencontainers.image.ref.name"], VERSION)
        self.assertIn(f"registry.example.com/gpusnap:{VERSION} sha256:", self.built)

    def test_every_blob_is_named_by_its_digest_and_the_archive_holds_the_layout(self):
        layout = self.output / "oci"
        blobs = sorted((layout / "blobs/sha256").iterdir())
        self.assertEqual(len(blobs), 3)  # config, manifest, one layer
        for b in blobs:
            self.assertEqual(hashlib.sha256(b.read_bytes()).hexdigest(), b.name)
        with tarfile.open(self.output / "gpusnap-image.tar") as t:
            names = sorted(m.name for m in t.getmembers() if m.isfile())
            docker = json.load(t.extractfile("manifest.json"))
        self.assertEqual(names, sorted(str(p.relative_to(layout)) for p in layout.rglob("*")
                                       if p.is_file()))
        self.assertEqual(docker[0]["RepoTags"], [f"registry.example.com/gpusnap:{VERSION}"])

    def test_the_programs_run_from_the_image(self):
        ds = daemonset()
        containers = {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}
        # The programs the DaemonSet starts, found on the image's PATH.
        self.assertEqual(self.run_in_image(containers["agent"]["command"] + ["--version"]),
                         (0, f"gpusnap-agent {VERSION}\n"))
        # The controller's container has a read-only root.
        self.assertTrue(containers["controller"]["securityContext"]["readOnlyRootFilesystem"])
        self.assertEqual(self.run_in_image(containers["controller"]["command"] + ["--version"],
                                           readonly=True),
                         (0, f"gpusnap-controller {VERSION}\n"))
        self.assertEqual(self.run_in_image(["gpusnap", "--version"]), (0, f"gpusnap {VERSION}\n"))
        # CRIU from the prefix, through its own loader, as the agent finds it.
        host = subprocess.run([str(CRIU_PREFIX / "criu"), "--version"], capture_output=True,
                              text=True)
        self.assertEqual(self.run_in_image(["/opt/gpusnap/criu/criu", "--version"]),
                         (0, host.stdout))
        # runc, through which the agent finds a container, with its libraries.
        host = subprocess.run(["runc", "--version"], capture_output=True, text=True)
        self.assertEqual(self.run_in_image(["runc", "--version"]), (0, host.stdout))
        # Bad input gets its one-line error from the image's programs too.
        code, out = self.run_in_image(["gpusnap-controller", "--bogus"])
        self.assertEqual((code, out), (2, "gpusnap-controller: error: unknown option --bogus "
                                          "(fix: see gpusnap-controller --help)\n"))

    def test_the_image_holds_the_glibc_libraries_the_driver_links(self):
        # The NVIDIA runtime mounts libcuda.so.1 and libnvidia-ml.so.1 into the agent's
        # container; they link these, and the agent dlopens them.
        code, out = self.run_in_image(["ls", "/lib/x86_64-linux-gnu"])
        self.assertEqual(code, 0, out)
        for lib in ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1"):
            self.assertIn(lib, out.split())

    def test_the_init_container_installs_gpusnap_on_the_host(self):
        ds = daemonset()
        init = ds["spec"]["template"]["spec"]["initContainers"][0]
        host_bin = self.dir / "host-bin"
        host_bin.mkdir()
        mount = next(m for m in init["volumeMounts"] if m["name"] == "host-bin")
        code, out = self.run_in_image(init["command"] + init["args"],
                                      mounts=[(host_bin, mount["mountPath"])])
        self.assertEqual(code, 0, out)
        installed = host_bin / "gpusnap"
        self.assertEqual(installed.stat().st_mode & 0o777, 0o755)
        self.assertEqual(sorted(p.name for p in host_bin.iterdir()),
                         ["gpusnap", "libgpusnap-preload.so", "libgpusnap-tier.so", "python"])
        # Next to gpusnap, where `gpusnap init` finds them for the pods' workloads.
        for lib in ("libgpusnap-preload.so", "libgpusnap-tier.so"):
            self.assertEqual((host_bin / lib).stat().st_mode & 0o777, 0o755)
        self.assertEqual(sorted(p.name for p in (host_bin / "python").iterdir()),
                         ["gpusnap_handshake.py", "sitecustomize.py"])
        for name in ("gpusnap_handshake.py", "sitecustomize.py"):
            self.assertEqual((host_bin / "python" / name).stat().st_mode & 0o777, 0o644)
        # The host runs it as placeholder pods will: with the host's glibc alone.
        r = subprocess.run([str(installed), "--version"], capture_output=True, text=True)
        self.assertEqual(r.stdout, f"gpusnap {VERSION}\n")
        # `gpusnap init --memory-tier` from the install, as a pod runs it: the workload's Python
        # gets the installed folder first on its path, and the client finds the installed tier
        # library beside the preload library.
        probe = ("import os, gpusnap_handshake as g; "
                 "print(os.environ['PYTHONPATH'].split(':')[0]); print(g.find_tier_library())")
        r = subprocess.run([str(installed), "init", "--memory-tier", "--", "python3", "-c", probe],
                           capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items()
                                if k not in ("PYTHONPATH", "GPUSNAP_PYTHON_SITE",
                                             "GPUSNAP_TIER_LIBRARY", "LD_PRELOAD")})
        self.assertEqual((r.returncode, r.stdout),
                         (0, f"{host_bin / 'python'}\n{host_bin / 'libgpusnap-tier.so'}\n"),
                         r.stderr)

    def test_the_agents_probes_ask_a_real_agent(self):
        ds = daemonset()
        agent = next(c for c in ds["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "agent")
        probes = {tuple(agent[k]["exec"]["command"])
                  for k in ("startupProbe", "livenessProbe", "readinessProbe")}
        self.assertEqual(len(probes), 1, probes)
        probe = list(probes.pop())
        sock_path = pathlib.Path(probe[probe.index("--agent") + 1])
        run_dir = self.dir / "run-gpusnap"
        run_dir.mkdir()
        mounts = [(run_dir, str(sock_path.parent))]
        # No agent: the image's gpusnap says it cannot reach it.
        code, out = self.run_in_image(probe, mounts=mounts)
        self.assertNotEqual(code, 0)
        self.assertIn(str(sock_path), out)
        # This build's agent on the host, its socket where the pod's mount puts it.
        state = self.dir / "agent"
        server = subprocess.Popen([str(BUILD / "gpusnap-agent"), "--socket",
                                   str(run_dir / sock_path.name), "--storage",
                                   str(state / "snapshots"), "--state-dir", str(state / "state"),
                                   "--run-dir", str(state / "run")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(600):
                if (run_dir / sock_path.name).exists() or server.poll() is not None:
                    break
                time.sleep(0.05)
            self.assertIsNone(server.poll())
            code, out = self.run_in_image(probe, mounts=mounts)
            self.assertEqual(code, 0, out)
            self.assertRegex(out, rf"^gpusnap {VERSION}\nagent {VERSION} on node \S+ "
                                  rf"\({sock_path}\)\n$")
        finally:
            server.terminate()
            server.wait(timeout=30)
            server.stderr.close()

if __name__ == "__main__":
    why = blocker()
    if why:
        print(f"skipped: {why}")
        sys.exit(77)
    unittest.main()
