"""``dsplug.zero_to_fp32``: the same names as ``dsplug.utils.zero_to_fp32`` (DeepSpeed's
``deepspeed.utils.zero_to_fp32``), kept at this shorter path.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the ZeRO plugin's ``zero_to_fp32`` module);
they are resolved on first use.
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
