"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``,
``ZeroParamStatus``, ``ZeroParamType``, ``register_external_parameter``,
``unregister_external_parameter``, ``is_zero_param``, ``shutdown_init_context`` /
``restore_init_context``.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the ZeRO stage-3 plugin); they are resolved on first
use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
