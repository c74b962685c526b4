"""Profiling tools, at DeepSpeed's import paths (``deepspeed.profiling.flops_profiler``)."""
import importlib

_SUBMODULES = {"flops_profiler"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
