"""A stand-in for PyTorch where there is none (CI machines), for the tests of the memory tier's
installation under `gpusnap run --memory-tier` (clients/python/gpusnap_site/sitecustomize.py): only what
gpusnap_handshake.use_memory_tier() and the handshake client reach, each call appended as one
line to the file $TORCH_STANDIN_LOG:

  import-begin / import-end                  this module's code ran (first and last line)
  allocator PATH ALLOC FREE                  CUDAPluggableAllocator(PATH, ALLOC, FREE): PATH is
                                             dlopened and both symbols looked up, as PyTorch does
  change_current_allocator                   the allocator was installed
  inductor-config                            torch._inductor.config was imported (a module of
                                             its own, as in PyTorch: loaded when first imported)
  inductor triton.NAME=VALUE                 one of its settings was changed

TORCH_STANDIN_REFUSE=1 makes change_current_allocator raise as PyTorch does once its allocator
has allocated. Kept in a folder of its own: a torch package beside the GPU workloads would hide
the real PyTorch.
"""

import ctypes
import os
import types


def _record(line):
    path = os.environ.get("TORCH_STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


_record("import-begin")


class CUDAPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        library = ctypes.CDLL(path_to_so_file)
        getattr(library, alloc_fn_name)
        getattr(library, free_fn_name)
        _record(f"allocator {path_to_so_file} {alloc_fn_name} {free_fn_name}")


def change_current_allocator(allocator):
    if not isinstance(allocator, CUDAPluggableAllocator):
        raise TypeError("not a CUDAPluggableAllocator")
    if os.environ.get("TORCH_STANDIN_REFUSE") == "1":
        raise RuntimeError("Can't swap an already initialized allocator")
    _record("change_current_allocator")


cuda = types.ModuleType("torch.cuda")
cuda.memory = types.ModuleType("torch.cuda.memory")
cuda.memory.CUDAPluggableAllocator = CUDAPluggableAllocator
cuda.memory.change_current_allocator = change_current_allocator
cuda.is_initialized = lambda: False  # the client's pause frees PyTorch's cache only after CUDA

_record("import-end")
