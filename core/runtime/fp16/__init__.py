"""DeepSpeed's ``deepspeed.runtime.fp16``: ``loss_scaler`` (imported on first use)."""
from __future__ import annotations

import importlib


def __getattr__(name):
    if name == "loss_scaler":
        return importlib.import_module(f"{__name__}.loss_scaler")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
