"""``dsplug.utils.groups`` (``deepspeed.utils.groups``): data-, model-, sequence- and
expert-parallel groups, from the plugin declaring this path (dsplug's own: the MoE plugin,
:mod:`dsplug.plugins.moe.groups`, which serves the kernel's :mod:`dsplug.comm.groups` names too)."""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
