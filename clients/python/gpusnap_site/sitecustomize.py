"""gpusnap's sitecustomize: the memory tier for a Python workload started by
`gpusnap run --memory-tier`, without the workload calling use_memory_tier() itself
(docs/memory-tier.md).

gpusnap puts this module's folder (its Python site folder, which also holds gpusnap_handshake.py)
first on the workload's PYTHONPATH and sets GPUSNAP_MEMORY_TIER=1. Python imports the first
`sitecustomize` on sys.path at startup: this one. It

- always imports the sitecustomize this folder hides, if there is one (Python imports only the
  first), so a PYTHONPATH that other programs inherit changes nothing for them;
- with GPUSNAP_MEMORY_TIER=1, and only then, puts a finder first in sys.meta_path that waits for
  `import torch`: once PyTorch's own module code has run, before the importer gets the module,
  it calls gpusnap_handshake.use_memory_tier(). Importing torch allocates no GPU memory, so this
  comes before the first allocation, as PyTorch requires of a change of allocator. Nothing is
  imported before: a process that never imports torch loads neither PyTorch nor
  gpusnap_handshake, and pays one string comparison per module it imports.

The gpusnap_handshake used is the one the workload already imported, if it imported one before
torch, else the one in this folder, registered under its name: the workload's later
`import gpusnap_handshake` then gets that same module (sys.modules), and its Client drains and
fills the tier installed here.

When the tier cannot be installed (no libgpusnap-tier.so, PyTorch refusing the allocator), one
line on stderr says why and what to do, and the workload goes on without the tier: its GPU memory
then goes through the driver's checkpoint, as for any workload. Nothing here raises into the
workload.
"""

import _thread
import os
import sys

MEMORY_TIER_VARIABLE = "GPUSNAP_MEMORY_TIER"
HANDSHAKE_MODULE = "gpusnap_handshake"
_HERE = os.path.dirname(os.path.abspath(__file__))
_hidden = None  # the sitecustomize this one hides, once imported (kept alive with this module)
_attempted = False  # the tier's installation was tried (once per process)


def _is_this_folder(entry):
    try:
        return os.path.samefile(entry or os.curdir, _HERE)
    except OSError:  # a missing folder, a zip file's member path
        return False


def _import_hidden_sitecustomize():
    """Imports the next sitecustomize on sys.path (the one this folder hides) as Python's site
    module would have, errors reported as site reports them. sys.path and
    sys.modules["sitecustomize"] are as before afterwards."""
    global _hidden
    ours = sys.modules.get(__name__)
    saved_path = sys.path[:]
    sys.path[:] = [entry for entry in saved_path if not _is_this_folder(entry)]
    sys.modules.pop(__name__, None)
    try:
        try:
            import sitecustomize  # noqa: PLC0415 - the next one on sys.path, not this module
            _hidden = sitecustomize
        except ImportError as e:
            if e.name != "sitecustomize":
                raise
    except Exception as e:  # noqa: BLE001 - as site.py: a broken sitecustomize stops nothing
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                         f"{type(e).__name__}: {e}\n")
    finally:
        sys.path[:] = saved_path
        sys.modules[__name__] = ours


def _warn(text):
    # One line, whatever the cause's text holds.
    line = " ".join(str(text).split())
    print(f"gpusnap --memory-tier: the memory tier is not installed, the workload runs without it "
          f"(its GPU memory goes through the driver's checkpoint): {line}", file=sys.stderr,
          flush=True)


def _give_up(text):
    """Says why the tier is not installed, once; no attempt follows."""
    global _attempted
    if not _attempted:
        _attempted = True
        _warn(text)


def _handshake_module():
    """The gpusnap_handshake the workload has, or this folder's, registered under its name."""
    module = sys.modules.get(HANDSHAKE_MODULE)
    if module is not None:
        return module
    import importlib.util  # noqa: PLC0415 - only once torch is imported

    path = os.path.join(_HERE, HANDSHAKE_MODULE + ".py")
    spec = importlib.util.spec_from_file_location(HANDSHAKE_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[HANDSHAKE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(HANDSHAKE_MODULE, None)
        raise
    return module


def _install_memory_tier():
    """gpusnap_handshake.use_memory_tier(), once per process, a failure said in one line on
    stderr. Never raises."""
    global _attempted
    if _attempted:
        return
    _attempted = True
    try:
        handshake = _handshake_module()
    except Exception as e:  # noqa: BLE001 - the workload must go on
        _warn(f"cannot load {os.path.join(_HERE, HANDSHAKE_MODULE + '.py')} ({e}); reinstall "
              f"gpusnap's Python folder, or point GPUSNAP_PYTHON_SITE at a complete one")
        return
    use = getattr(handshake, "use_memory_tier", None)
    if use is None:
        where = getattr(handshake, "__file__", "?")
        _warn(f"the {HANDSHAKE_MODULE} the workload imported ({where}) has no use_memory_tier(); "
              f"use the one gpusnap ships, in {_HERE}")
        return
    try:
        use()
    except Exception as e:  # noqa: BLE001 - TierError names cause and fix; anything else too
        _warn(e)


class _InstallTierAfter:
    """PyTorch's own loader, with the tier installed once torch's module code has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # PyTorch's code, and anyone after, sees its own loader, as without this hook.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)  # a failed import leaves the finder for the next try
        _remove_finder()
        _install_memory_tier()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _TorchImportFinder:
    """A sys.meta_path finder for the module `torch` alone: finds its spec through the other
    finders, and wraps the loader so that the tier is installed right after torch's import."""

    def __init__(self):
        self._searching = set()  # threads inside find_spec: a finder may search again

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or _thread.get_ident() in self._searching:
            return None
        self._searching.add(_thread.get_ident())
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            self._searching.discard(_thread.get_ident())
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _InstallTierAfter(spec.loader)
        else:
            _give_up(f"torch is loaded by {spec.loader!r}, which cannot be followed; call "
                     f"gpusnap_handshake.use_memory_tier() before the workload imports torch")
        return spec

    def _find_elsewhere(self, fullname, path, target):
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


def _remove_finder():
    for finder in [f for f in sys.meta_path if isinstance(f, _TorchImportFinder)]:
        try:
            sys.meta_path.remove(finder)
        except ValueError:  # another thread's import removed it
            pass


def _install_finder():
    """The finder first in sys.meta_path; or, when torch is imported already (by a .pth file or
    the hidden sitecustomize), the tier installed now."""
    _remove_finder()
    if "torch" in sys.modules:
        _install_memory_tier()
    elif not _attempted:
        sys.meta_path.insert(0, _TorchImportFinder())


if os.environ.get(MEMORY_TIER_VARIABLE) == "1":
    _install_finder()
    _import_hidden_sitecustomize()
    # Again: the hidden sitecustomize may have imported torch, or put finders of its own first.
    _install_finder()
else:
    _import_hidden_sitecustomize()
