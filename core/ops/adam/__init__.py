"""``deepspeed.ops.adam`` names: ``DeepSpeedCPUAdam`` (alias ``CPUAdam``), the kernel's native op,
and ``FusedAdam``.

``FusedAdam`` is the Adam optimizer plugin's class: the plugin declares this path through the
``dsplug_api_modules`` hook and the name is resolved on first use through the registry (so a
blocked or missing plugin is named in the ImportError). Names defined here stay the kernel's.
"""
from __future__ import annotations

from dsplug.public import forward_to_plugin

from .cpu_adam import CPUAdam, DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam", "CPUAdam"]

__getattr__, _plugin_dir = forward_to_plugin(__name__)


def __dir__():
    return sorted(set(__all__) | set(_plugin_dir()))
