"""``dsplug.runtime.pipe.engine`` (DeepSpeed's ``deepspeed.runtime.pipe.engine``), from the plugin declaring
this path (dsplug's own: ``dsplug.plugins.pipe.engine``); see :mod:`dsplug.public`."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
