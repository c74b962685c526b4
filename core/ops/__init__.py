"""DeepSpeed's ``deepspeed.ops`` names, backed by dsplug's native ops (or their pure-torch
fallbacks): ``dsplug.ops.adam.DeepSpeedCPUAdam``, ``dsplug.ops.adagrad.DeepSpeedCPUAdagrad``,
``dsplug.ops.lion.DeepSpeedCPULion``, ``dsplug.ops.op_builder.AsyncIOBuilder``, ``dsplug.ops.aio``.

Submodules, the kernel's and those plugins declare (``dsplug.ops.sparse_attention``,
``dsplug.ops.lamb``), are imported on first attribute access (see :mod:`dsplug.api_paths`).
"""
from __future__ import annotations

from dsplug.api_paths import plugin_names

__getattr__, __dir__ = plugin_names(__name__)
