"""DeepSpeed's ``deepspeed.elasticity.config``, forwarded to the plugin that provides it
(see :mod:`dsplug.public`)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
