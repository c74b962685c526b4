"""``deepspeed.ops.lion``: ``DeepSpeedCPULion``, the kernel's native CPU Lion.

Plugins may add names here through ``dsplug_api_modules`` (see :mod:`dsplug.api_paths`).
"""
from dsplug.api_paths import plugin_names

from .cpu_lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]

__getattr__, __dir__ = plugin_names(__name__)
