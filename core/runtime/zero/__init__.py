"""DeepSpeed's ``deepspeed.runtime.zero``: ``config`` (the ZeRO config model) and
``partition_parameters`` (ZeRO-3's ``Init``, ``GatheredParameters``, ``ZeroParamStatus`` ...).
Both come from the ZeRO plugin; they are imported on first use. ``Init``, ``GatheredParameters``
and the other names of ``dsplug.zero`` are reachable here too, as in DeepSpeed.
"""
from __future__ import annotations

import importlib

_SUBMODULES = {"config", "partition_parameters"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if not name.startswith("__"):
        return getattr(importlib.import_module("dsplug.zero"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
