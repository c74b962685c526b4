"""DeepSpeed's ``deepspeed.runtime.lr_schedules`` import path.

The schedules (``WarmupLR``, ``OneCycle``, ...), ``VALID_LR_SCHEDULES`` and DeepSpeed's
parameter-name constants come from the plugin that declares this path through the
``dsplug_api_modules`` hook (the built-in scheduler plugins), resolved on first use through the
registry: ``from dsplug.runtime.lr_schedules import WarmupLR`` works as in DeepSpeed, and a
blocked or missing plugin is named in the ImportError.
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
