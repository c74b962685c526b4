"""``deepspeed.ops.adam`` names: ``DeepSpeedCPUAdam`` (alias ``CPUAdam``).

``FusedAdam`` is the Adam optimizer plugin's class (``dsplug.plugins.optimizers``), resolved on
first access.
"""
from __future__ import annotations

from .cpu_adam import CPUAdam, DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam", "CPUAdam"]


def __getattr__(name):
    # dsplug's FusedAdam is the Adam optimizer plugin's class; imported on first use
    if name == "FusedAdam":
        from dsplug.plugins.optimizers.adam_optimizer import FusedAdam

        return FusedAdam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
