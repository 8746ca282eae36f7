#!/usr/bin/env python3
"""The Python client as a package (clients/python): it installs with pip offline
(`pip install --no-build-isolation --no-index`, setuptools from the system), the installed copy
is the package with its py.typed and gpusnap's version in its metadata, the version is the
top-level CMakeLists.txt's project version as the C++ client header's macros are, and every
public function and method is annotated and documented."""

import ast
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(os.environ.get("GPUSNAP_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
PACKAGE = ROOT / "clients" / "python"
SOURCE = PACKAGE / "gpusnap_handshake" / "__init__.py"
HEADER = ROOT / "clients" / "include" / "gpusnap" / "handshake_client.h"


def project_version():
    """The one source of truth: project(gpusnap VERSION X.Y.Z) in CMakeLists.txt."""
    m = re.search(r"^project\(gpusnap VERSION (\d+)\.(\d+)\.(\d+)\b", (ROOT / "CMakeLists.txt").read_text(),
                  re.M)
    assert m, "no project(gpusnap VERSION ...) in CMakeLists.txt"
    return tuple(int(x) for x in m.groups())


def builder():
    """A Python that can build the package offline: pip, setuptools >= 61 and wheel (which
    setuptools of Debian 12 needs to build a wheel). This one, else the system's."""
    probe = ("import setuptools, wheel, pip; "
             "assert tuple(int(x) for x in setuptools.__version__.split('.')[:2]) >= (61, 0)")
    for python in (sys.executable, "/usr/bin/python3"):
        if python and os.path.exists(python) and subprocess.run(
                [python, "-c", probe], capture_output=True).returncode == 0:
            return python
    return None


class VersionTest(unittest.TestCase):
    def test_python_and_cpp_clients_carry_the_project_version(self):
        major, minor, patch = project_version()
        version = f"{major}.{minor}.{patch}"
        if "GPUSNAP_VERSION" in os.environ:  # ctest passes CMake's PROJECT_VERSION
            self.assertEqual(os.environ["GPUSNAP_VERSION"], version)
        # The Python client's, read as setuptools reads it (a literal, not by importing).
        tree = ast.parse(SOURCE.read_text())
        found = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__version__"]]
        self.assertEqual(found, [version])
        header = HEADER.read_text()
        self.assertIn(f'#define GPUSNAP_CLIENT_VERSION "{version}"\n', header)
        for name, value in (("MAJOR", major), ("MINOR", minor), ("PATCH", patch)):
            self.assertIn(f"#define GPUSNAP_CLIENT_VERSION_{name} {value}\n", header)


class InstallTest(unittest.TestCase):
    def setUp(self):
        self.python = builder()
        if self.python is None:
            self.skipTest("no Python with pip, setuptools >= 61 and wheel "
                          "(apt-get install python3-pip python3-setuptools python3-wheel)")
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="gpusnap-pip-"))
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def test_pip_installs_the_typed_package_offline(self):
        # pip builds in the source folder: build from a copy, leaving the tree clean.
        source = self.dir / "source"
        shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns(
            "__pycache__", "build", "*.egg-info", "gpusnap_site"))
        target = self.dir / "site"
        r = subprocess.run([self.python, "-m", "pip", "install", "--no-build-isolation",
                            "--no-index", "--no-deps", "--disable-pip-version-check",
                            "--target", str(target), str(source)],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        version = ".".join(str(x) for x in project_version())
        installed = target / "gpusnap_handshake"
        self.assertEqual(sorted(p.name for p in installed.iterdir() if p.name != "__pycache__"),
                         ["__init__.py", "py.typed"])
        self.assertEqual((installed / "__init__.py").read_text(), SOURCE.read_text())
        metadata = (target / f"gpusnap_handshake-{version}.dist-info" / "METADATA").read_text()
        self.assertIn("Name: gpusnap-handshake\n", metadata)
        self.assertIn(f"Version: {version}\n", metadata)
        self.assertIn("Classifier: Typing :: Typed\n", metadata)
        # Imported from there, by a Python that sees nothing else of the tree.
        r = subprocess.run(
            [sys.executable, "-I", "-c",
             "import sys; sys.path.insert(0, sys.argv[1]); import importlib.metadata as m; "
             "import gpusnap_handshake as g; "
             "print(g.__version__, m.version('gpusnap-handshake'), g.__file__)", str(target)],
            capture_output=True, text=True, cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split(), [version, version, str(installed / "__init__.py")])


class PublicApiTest(unittest.TestCase):
    def test_every_public_function_is_annotated_and_documented(self):
        sys.path.insert(0, str(PACKAGE))
        try:
            import gpusnap_handshake as g
        finally:
            sys.path.remove(str(PACKAGE))
        self.assertTrue(g.__doc__)
        checked, problems = 0, []

        def check(name, f):
            nonlocal checked
            checked += 1
            sig = inspect.signature(f)
            for p in sig.parameters.values():
                if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                    problems.append(f"{name}: parameter {p.name} has no annotation")
            if sig.return_annotation is inspect.Signature.empty:
                problems.append(f"{name}: no return annotation")
            if not f.__doc__ and name.rsplit(".", 1)[-1] not in ("__init__", "__enter__",
                                                                  "__exit__"):
                problems.append(f"{name}: no docstring")

        for name, obj in vars(g).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != g.__name__:
                continue
            if inspect.isfunction(obj):
                check(name, obj)
            elif inspect.isclass(obj):
                if not obj.__doc__:
                    problems.append(f"{name}: no docstring")
                for member, value in vars(obj).items():
                    if member.startswith("_") and member not in ("__init__", "__enter__",
                                                                 "__exit__"):
                        continue
                    if isinstance(value, property):
                        value = value.fget
                    value = getattr(value, "__func__", value)
                    # Not what a base class brings (Protocol's __init__).
                    if inspect.isfunction(value) and value.__module__ == g.__name__:
                        check(f"{name}.{member}", value)
        self.assertEqual(problems, [])
        self.assertGreaterEqual(checked, 40)


if __name__ == "__main__":
    unittest.main()
