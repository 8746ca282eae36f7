"""The stand-in's torch._inductor.config: the one setting gpusnap's memory tier changes
(triton.cudagraph_trees, True as in PyTorch), every change logged (torch/__init__.py)."""

from torch import _record


class _Triton:
    def __init__(self):
        object.__setattr__(self, "cudagraph_trees", True)

    def __setattr__(self, name, value):
        _record(f"inductor triton.{name}={value}")
        object.__setattr__(self, name, value)


triton = _Triton()
_record("inductor-config")
