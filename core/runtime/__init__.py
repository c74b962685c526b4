"""DeepSpeed's ``deepspeed.runtime`` import paths, kept for scripts and integrations that use them.

The kernel's: :mod:`.config` (``DeepSpeedConfig``, a config's values under DeepSpeed's attribute
names, and the config-key constants of :mod:`.constants`) and :mod:`.engine`
(``DeepSpeedEngine``). The others (``lr_schedules``, ``zero``, ``fp16``, ``pipe``,
``activation_checkpointing``, ``data_pipeline`` ...) come from the plugins that declare them
(``dsplug_api_modules``; see :mod:`dsplug.api_paths`).

Submodules are imported on first attribute access, so ``dsplug.runtime.lr_schedules.VALID_LR_SCHEDULES``
works right after ``import dsplug`` as ``deepspeed.runtime...`` does after ``import deepspeed``.
"""
from __future__ import annotations

from dsplug.api_paths import plugin_names

__getattr__, __dir__ = plugin_names(__name__)
