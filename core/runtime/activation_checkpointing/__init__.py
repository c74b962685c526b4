"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing`` package: its :mod:`.checkpointing`
module is the same API as ``dsplug.checkpointing`` (from the plugin declaring the path)."""
from __future__ import annotations

import importlib


def __getattr__(name):
    if name == "checkpointing":
        return importlib.import_module(f"{__name__}.checkpointing")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
