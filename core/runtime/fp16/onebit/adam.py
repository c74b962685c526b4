"""``dsplug.runtime.fp16.onebit.adam``: DeepSpeed's ``deepspeed.runtime.fp16.onebit.adam.OnebitAdam``, from the
plugin declaring this path (dsplug's own: ``dsplug.plugins.onebit.adam``)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
