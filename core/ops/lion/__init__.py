"""``deepspeed.ops.lion``: ``DeepSpeedCPULion``, the kernel's native CPU Lion, and ``FusedLion``,
Lion in torch foreach ops on any device.

Plugins may add names here through ``dsplug_api_modules`` (see :mod:`dsplug.api_paths`).
"""
from dsplug.api_paths import plugin_names

from .cpu_lion import DeepSpeedCPULion
from .fused_lion import FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

__getattr__, __dir__ = plugin_names(__name__)
