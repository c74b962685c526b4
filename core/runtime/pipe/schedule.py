"""``dsplug.runtime.pipe.schedule`` (DeepSpeed's ``deepspeed.runtime.pipe.schedule``), from the plugin declaring
this path (dsplug's own: ``dsplug.plugins.pipe.schedule``); see :mod:`dsplug.public`."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
