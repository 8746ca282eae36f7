"""gpusnap's Python site folder (clients/python/gpusnap_site/sitecustomize.py, with gpusnap_handshake.py
beside it): what `gpusnap run --memory-tier` gives a Python workload. Each test runs a real
python3 with the folder first on PYTHONPATH, as gpusnap starts the workload, and the stand-in for
PyTorch (tests/workload/torch_standin/torch) after it, which logs every call it gets; the
allocator it is given is the built libgpusnap-tier.so.

Plain unittest, standard library only. ctest names the built folder and library
(GPUSNAP_PYTHON_SITE_BUILT, GPUSNAP_TIER_BUILT); by hand:
  GPUSNAP_PYTHON_SITE_BUILT=build/python GPUSNAP_TIER_BUILT=build/libgpusnap-tier.so \\
      python3 tests/handshake/test_python_site.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STANDIN = os.path.join(ROOT, "tests", "workload", "torch_standin")
SITE = os.environ.get("GPUSNAP_PYTHON_SITE_BUILT", "")
LIBRARY = os.environ.get("GPUSNAP_TIER_BUILT", "")

# The workload's report, printed as its last line: what it sees after its imports.
REPORT = """
import json, sys
hs = sys.modules.get("gpusnap_handshake")
tier = getattr(hs, "_installed_tier", None)
print(json.dumps({
    "torch": "torch" in sys.modules,
    "handshake": hs is not None,
    "handshake_file": getattr(hs, "__file__", None),
    "tier_path": getattr(tier, "path", None),
    "client_sees_the_tier": hs is not None and tier is not None
                            and hs.Client(None)._tier() is tier,
    "finders": [type(f).__name__ for f in sys.meta_path],
    "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    "path": sys.path,
    "modules": sorted(sys.modules),
}))
"""


class SiteFolderTest(unittest.TestCase):
    def setUp(self):
        if not SITE or not os.path.exists(os.path.join(SITE, "sitecustomize.py")):
            self.skipTest("skipped: GPUSNAP_PYTHON_SITE_BUILT names no built site folder")
        if not LIBRARY or not os.path.exists(LIBRARY):
            self.skipTest("skipped: GPUSNAP_TIER_BUILT names no built library")
        self.root = tempfile.mkdtemp(prefix="gpusnap-site-")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.log = os.path.join(self.root, "torch.log")

    def run_workload(self, code, memory_tier="1", path_after=(), env=None, site=True):
        """Runs `code` (then REPORT) as a workload started by `gpusnap run --memory-tier`
        would be: our folder first on PYTHONPATH (unless not `site`), then `path_after`, then the
        stand-in. Returns (report, stderr, the stand-in's log lines)."""
        script = os.path.join(self.root, "app.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(code) + REPORT)
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("GPUSNAP_", "TORCH_STANDIN_", "PYTHON"))
                    and k != "LD_PRELOAD"}
        full_env.update({"PYTHONPATH": os.pathsep.join([*([SITE] if site else []), *path_after,
                                                        STANDIN]),
                         "GPUSNAP_TIER_LIBRARY": LIBRARY, "TORCH_STANDIN_LOG": self.log,
                         "PYTHONDONTWRITEBYTECODE": "1"})
        if memory_tier is not None:
            full_env["GPUSNAP_MEMORY_TIER"] = memory_tier
        full_env.update(env or {})
        full_env = {k: v for k, v in full_env.items() if v is not None}
        proc = subprocess.run([sys.executable, script], env=full_env, capture_output=True,
                              text=True, timeout=60, check=False)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        lines = []
        if os.path.exists(self.log):
            with open(self.log) as f:
                lines = f.read().splitlines()
        return json.loads(proc.stdout.splitlines()[-1]), proc.stderr, lines

    def mark(self, what):
        """Code that appends `what` to the stand-in's log, from the workload."""
        return f"open({self.log!r}, 'a').write({what!r} + '\\n')\n"

    def installed(self):
        return [f"allocator {LIBRARY} tier_malloc tier_free", "change_current_allocator"]

    def test_the_tier_is_installed_once_right_after_torch_is_imported(self):
        report, err, log = self.run_workload(
            "import sys\n"
            "assert 'gpusnap_handshake' not in sys.modules\n" + self.mark("app: before") +
            "import torch\n" + self.mark("app: after") +
            "import torch, torch as again\n"  # imported: nothing more happens
            "import gpusnap_handshake\n"
            "assert gpusnap_handshake.use_memory_tier() is gpusnap_handshake._installed_tier\n")
        self.assertEqual(err, "")
        # Not before torch's own code ran; before the workload got the module back; once.
        self.assertEqual(log, ["app: before", "import-begin", "import-end", *self.installed(),
                               "app: after"])
        self.assertEqual(report["tier_path"], LIBRARY)
        # The workload's `import gpusnap_handshake` got the module that installed the tier, from
        # our folder, and its client drains and fills that tier.
        self.assertEqual(report["handshake_file"], os.path.join(SITE, "gpusnap_handshake.py"))
        self.assertTrue(report["client_sees_the_tier"])
        self.assertNotIn("_TorchImportFinder", report["finders"])  # done with, removed
        self.assertEqual(report["sitecustomize"], os.path.join(SITE, "sitecustomize.py"))

    def test_torch_compiles_graph_trees_are_turned_off_when_inductor_is_loaded(self):
        # PyTorch's graph trees need its own allocator: with the tier, reduce-overhead would
        # raise at the first compiled call. Turned off when Inductor's configuration loads.
        report, err, log = self.run_workload(
            "import torch\n" + self.mark("app: compiles") +
            "import torch._inductor.config as config\n"
            "assert config.triton.cudagraph_trees is False\n")
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", *self.installed(), "app: compiles",
                               "inductor-config", "inductor triton.cudagraph_trees=False"])
        self.assertNotIn("_InductorConfigFinder", report["finders"])  # done with, removed

    def test_a_workload_that_never_compiles_loads_no_inductor(self):
        report, err, log = self.run_workload("import torch\n")
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", *self.installed()])
        self.assertNotIn("torch._inductor.config", report["modules"])
        self.assertIn("_InductorConfigFinder", report["finders"])  # waits, costs nothing more

    def test_inductor_loaded_before_the_one_line_gets_its_trees_turned_off_at_once(self):
        report, err, log = self.run_workload(
            "import torch, torch._inductor.config as config\n"
            "import gpusnap_handshake\n"
            "gpusnap_handshake.use_memory_tier()\n"
            "assert config.triton.cudagraph_trees is False\n", memory_tier=None)
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", "inductor-config", *self.installed(),
                               "inductor triton.cudagraph_trees=False"])
        self.assertNotIn("_InductorConfigFinder", report["finders"])

    def test_without_the_tier_inductor_is_left_alone(self):
        _, err, log = self.run_workload(
            "import torch, torch._inductor.config as config\n"
            "assert config.triton.cudagraph_trees is True\n", memory_tier=None)
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", "inductor-config"])

    def test_a_workload_that_also_calls_use_memory_tier_gets_one_tier(self):
        _, err, log = self.run_workload(
            "import gpusnap_handshake\n"
            "tier = gpusnap_handshake.use_memory_tier()\n"
            "import torch\n"
            "assert gpusnap_handshake.use_memory_tier() is tier\n")
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", *self.installed()])

    def test_the_workloads_own_handshake_module_imported_first_is_the_one_used(self):
        own = os.path.join(self.root, "own")
        os.mkdir(own)
        shutil.copy(os.path.join(SITE, "gpusnap_handshake.py"), own)
        report, err, log = self.run_workload(
            f"import sys\nsys.path.insert(0, {own!r})\n"
            "import gpusnap_handshake\n"
            "import torch\n")
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", *self.installed()])
        self.assertEqual(report["handshake_file"], os.path.join(own, "gpusnap_handshake.py"))
        self.assertTrue(report["client_sees_the_tier"])

    def test_a_process_that_never_imports_torch_loads_nothing_more(self):
        code = "import json, os, collections\n"
        report, err, log = self.run_workload(code)
        plain, _, _ = self.run_workload(code, site=False)
        self.assertEqual(err, "")
        self.assertEqual(log, [])
        self.assertFalse(report["torch"])
        self.assertFalse(report["handshake"])
        self.assertIn("_TorchImportFinder", report["finders"])
        # The modules of the same program without our folder, and our sitecustomize: the hook
        # imported nothing.
        self.assertEqual(set(report["modules"]) - set(plain["modules"]), {"sitecustomize"})
        self.assertEqual(set(plain["modules"]) - set(report["modules"]), set())

    def test_without_the_variable_nothing_happens(self):
        for value in (None, "0", ""):
            with self.subTest(GPUSNAP_MEMORY_TIER=value):
                os.unlink(self.log) if os.path.exists(self.log) else None
                report, err, log = self.run_workload("import torch\n", memory_tier=value)
                self.assertEqual(err, "")
                self.assertEqual(log, ["import-begin", "import-end"])
                self.assertFalse(report["handshake"])
                self.assertNotIn("_TorchImportFinder", report["finders"])

    def hidden_sitecustomize(self, body):
        other = os.path.join(self.root, "other-site")
        os.makedirs(other, exist_ok=True)
        with open(os.path.join(other, "sitecustomize.py"), "w") as f:
            f.write(textwrap.dedent(body))
        return other

    def test_the_sitecustomize_our_folder_hides_still_runs(self):
        marker = os.path.join(self.root, "hidden-ran")
        other = self.hidden_sitecustomize(f"""
            import sys
            open({marker!r}, "w").write(repr(sys.path))
            """)
        for memory_tier in ("1", None):
            with self.subTest(GPUSNAP_MEMORY_TIER=memory_tier):
                os.unlink(marker) if os.path.exists(marker) else None
                report, err, _ = self.run_workload("pass\n", memory_tier=memory_tier,
                                                   path_after=[other])
                self.assertEqual(err, "")
                with open(marker) as f:
                    seen = f.read()
                self.assertNotIn(repr(SITE), seen)  # it ran with our folder off the path
                self.assertIn(SITE, report["path"])  # which is back for the workload
                self.assertEqual(report["sitecustomize"], os.path.join(SITE, "sitecustomize.py"))

    def test_a_hidden_sitecustomize_that_fails_is_reported_as_python_reports_it(self):
        other = self.hidden_sitecustomize("raise ValueError('broken on purpose')\n")
        report, err, log = self.run_workload("import torch\n", path_after=[other])
        self.assertEqual(err, "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                              "ValueError: broken on purpose\n")
        self.assertEqual(log, ["import-begin", "import-end", *self.installed()])
        self.assertTrue(report["client_sees_the_tier"])

    def test_torch_imported_by_the_hidden_sitecustomize_gets_the_tier_too(self):
        other = self.hidden_sitecustomize("import torch\n")
        report, err, log = self.run_workload("pass\n", path_after=[other])
        self.assertEqual(err, "")
        self.assertEqual(log, ["import-begin", "import-end", *self.installed()])
        self.assertTrue(report["client_sees_the_tier"])

    def assert_one_line_and_no_tier(self, err, log, *phrases):
        lines = err.splitlines()
        self.assertEqual(len(lines), 1, err)
        self.assertTrue(lines[0].startswith(
            "gpusnap --memory-tier: the memory tier is not installed, the workload runs without "
            "it (its GPU memory goes through the driver's checkpoint): "), lines[0])
        for phrase in phrases:
            self.assertIn(phrase, lines[0])
        self.assertNotIn("change_current_allocator", log)

    def test_a_library_that_cannot_be_loaded_is_said_in_one_line_and_the_workload_goes_on(self):
        report, err, log = self.run_workload(
            "import torch\nprint('still serving')\n",
            env={"GPUSNAP_TIER_LIBRARY": "/nonexistent/libgpusnap-tier.so"})
        self.assert_one_line_and_no_tier(
            err, log, "cannot load /nonexistent/libgpusnap-tier.so",
            "set GPUSNAP_TIER_LIBRARY to gpusnap's libgpusnap-tier.so")
        self.assertIsNone(report["tier_path"])

    def test_no_library_anywhere_is_said_in_one_line(self):
        if os.path.exists("/opt/gpusnap/bin/libgpusnap-tier.so"):
            self.skipTest("skipped: this host has gpusnap's library installed")
        _, err, log = self.run_workload("import torch\n", env={"GPUSNAP_TIER_LIBRARY": None})
        self.assert_one_line_and_no_tier(err, log, "libgpusnap-tier.so not found",
                                         "set GPUSNAP_TIER_LIBRARY to its path")

    def test_an_allocator_pytorch_refuses_is_said_in_one_line(self):
        _, err, log = self.run_workload("import torch\n", env={"TORCH_STANDIN_REFUSE": "1"})
        self.assert_one_line_and_no_tier(err, log, "PyTorch refused the allocator",
                                         "Can't swap an already initialized allocator")

    def test_a_handshake_module_without_the_tier_is_said_in_one_line(self):
        old = os.path.join(self.root, "old")
        os.mkdir(old)
        with open(os.path.join(old, "gpusnap_handshake.py"), "w") as f:
            f.write("class Client:\n    pass\n")
        _, err, log = self.run_workload(
            f"import sys\nsys.path.insert(0, {old!r})\nimport gpusnap_handshake\nimport torch\n")
        self.assert_one_line_and_no_tier(err, log, "has no use_memory_tier()",
                                         "use the one gpusnap ships")


if __name__ == "__main__":
    unittest.main()
