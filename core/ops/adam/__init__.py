"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` (alias ``CPUAdam``), the kernel's native CPU Adam.

Plugins add names here through ``dsplug_api_modules`` (dsplug's Adam optimizer plugin adds
``FusedAdam``); they are looked up on first use (see :mod:`dsplug.api_paths`).
"""
from __future__ import annotations

from dsplug.api_paths import plugin_names

from .cpu_adam import CPUAdam, DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam", "CPUAdam"]

__getattr__, __dir__ = plugin_names(__name__)
