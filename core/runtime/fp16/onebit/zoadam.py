"""``dsplug.runtime.fp16.onebit.zoadam``: DeepSpeed's ``deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam``, from the
plugin declaring this path (dsplug's own: ``dsplug.plugins.onebit.zoadam``)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
