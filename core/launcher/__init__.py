"""DeepSpeed's ``deepspeed.launcher``: :mod:`.runner` (hostfile and resource-filter functions,
``main``), imported on first use. The command itself is ``dsplug launch``."""
from __future__ import annotations

import importlib


def __getattr__(name):
    if name == "runner":
        return importlib.import_module(f"{__name__}.runner")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
