"""The flops profiler: parameters, MACs, FLOPs and latency per module of a PyTorch model.

* :func:`get_model_profile` profiles one forward pass standalone;
* :class:`FlopsProfiler` profiles whatever runs between ``start_profile`` and ``stop_profile``;
* the ``flops_profiler`` config section turns on an engine observer (:mod:`.plugin`) that
  profiles one training step.

``dsplug.profiling.flops_profiler`` (DeepSpeed's path) forwards to this package's public names
(declared by :mod:`.plugin`). Names are imported lazily so that loading the plugin does not
import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "get_model_profile": "standalone",
    "FlopsProfiler": "profiler",
    "ModuleProfile": "profiler",
    "get_module_flops": "profiler",
    "get_module_macs": "profiler",
    "get_module_params": "profiler",
    "get_module_duration": "profiler",
    "number_to_string": "formatting",
    "macs_to_string": "formatting",
    "flops_to_string": "formatting",
    "params_to_string": "formatting",
    "duration_to_string": "formatting",
    "bytes_to_string": "formatting",
    "StepLatency": "report",
    "FlopsProfilerConfig": "config",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
