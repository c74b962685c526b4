"""DeepSpeed's ``deepspeed.ops`` names, backed by dsplug's native ops (or their pure-torch
fallbacks): ``dsplug.ops.adam.DeepSpeedCPUAdam``, ``dsplug.ops.adagrad.DeepSpeedCPUAdagrad``,
``dsplug.ops.lion.DeepSpeedCPULion``, ``dsplug.ops.op_builder.AsyncIOBuilder``, ``dsplug.ops.aio``,
``dsplug.ops.sparse_attention`` (from the sparse attention plugin).
Submodules are imported on first use.
"""
from __future__ import annotations

import importlib

_SUBMODULES = {"adam", "adagrad", "lion", "lamb", "aio", "op_builder", "native", "sparse_attention"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
