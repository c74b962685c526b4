"""DeepSpeed's ``deepspeed.profiling.flops_profiler`` import path.

The names (``get_model_profile``, ``FlopsProfiler``, ``get_module_flops``, ``flops_to_string``
...) come from the plugin that declares this path through the ``dsplug_api_modules`` hook (the
built-in flops profiler observer), resolved on first use through the registry: a blocked or
missing plugin is named in the ImportError. Importing this module imports nothing else.
"""
import importlib

from dsplug.public import forward_to_plugin

_forward, __dir__ = forward_to_plugin(__name__)


def __getattr__(name):
    if name == "profiler":  # the submodule at DeepSpeed's path, never the plugin's own
        return importlib.import_module(f"{__name__}.profiler")
    return _forward(name)
