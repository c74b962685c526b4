"""dsplug: a DeepSpeed-compatible training engine for PyTorch where every feature is a plugin.

``import dsplug as deepspeed`` keeps DeepSpeed scripts working. The heavy parts (torch, the
engine) are imported on first use so that ``dsplug list`` stays fast.
"""
from __future__ import annotations

import importlib

from . import api_paths as _api_paths
from .descriptors import CATEGORIES, PluginSpec
from .hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

# name -> (module, attribute): resolved lazily by __getattr__ below
_LAZY = {
    "initialize": ("dsplug.api", "initialize"),
    "init_distributed": ("dsplug.api", "init_distributed"),
    "add_config_arguments": ("dsplug.api", "add_config_arguments"),
    "add_tuning_arguments": ("dsplug.runtime.lr_schedules", "add_tuning_arguments"),
    "DeepSpeedEngine": ("dsplug.engine", "Engine"),
    "PipelineModule": ("dsplug.pipe", "PipelineModule"),
    "PipelineEngine": ("dsplug.runtime.pipe.engine", "PipelineEngine"),
    "Engine": ("dsplug.engine", "Engine"),
    "DsplugConfig": ("dsplug.config", "DsplugConfig"),
    "ConfigError": ("dsplug.config", "ConfigError"),
    "DeepSpeedConfigError": ("dsplug.config", "ConfigError"),
    "DeepSpeedConfig": ("dsplug.runtime.config", "DeepSpeedConfig"),
    "get_registry": ("dsplug.registry", "get_registry"),
    "get_accelerator": ("dsplug.accelerator", "get_accelerator"),
}
__all__ = ["PluginSpec", "CATEGORIES", "hookimpl", "hookspec", "__version__", *_LAZY]

# DeepSpeed's import paths that plugins provide (dsplug.zero, dsplug.moe ...) are served by one finder
_api_paths.install()
_child, _children = _api_paths.plugin_names(__name__)


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    try:
        return _child(name)  # a submodule: the kernel's or an import path a plugin declares
    except AttributeError:
        from .unavailable import attribute_error  # DeepSpeed names dsplug lacks: a clear ImportError

        error = attribute_error(name)
        if error is not None:
            raise error from None
        raise


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_children()))
