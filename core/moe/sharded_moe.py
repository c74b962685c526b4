"""``dsplug.moe.sharded_moe`` (``deepspeed.moe.sharded_moe``):
``TopKGate``, ``MOELayer``, ``top1gating``, ``top2gating``, ``topkgating``, from the plugin declaring this path."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
