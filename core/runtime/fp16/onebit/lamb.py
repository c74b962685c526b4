"""``dsplug.runtime.fp16.onebit.lamb``: DeepSpeed's ``deepspeed.runtime.fp16.onebit.lamb.OnebitLamb``, from the
plugin declaring this path (dsplug's own: ``dsplug.plugins.onebit.lamb``)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
