"""``dsplug.pipe`` (DeepSpeed's ``deepspeed.pipe``): ``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``, the process topologies and ``PipelineEngine``.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the pipeline plugin, ``dsplug.plugins.pipe``); they
are resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
