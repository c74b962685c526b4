"""``dsplug.moe.experts`` (``deepspeed.moe.experts``): ``Experts``, from the plugin declaring this path."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
