"""``deepspeed.ops.lamb`` names: ``FusedLamb`` (the Lamb optimizer plugin's class)."""
from __future__ import annotations

__all__ = ["FusedLamb"]


def __getattr__(name):
    if name == "FusedLamb":
        from dsplug.plugins.optimizers.lamb_optimizer import FusedLamb

        return FusedLamb
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
