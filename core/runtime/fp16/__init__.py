"""DeepSpeed's ``deepspeed.runtime.fp16``: ``loss_scaler`` and ``onebit`` (imported on first use)."""
from __future__ import annotations

import importlib


def __getattr__(name):
    if name in ("loss_scaler", "onebit"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
