"""``dsplug.zero``: DeepSpeed's ``deepspeed.zero`` API for ZeRO stage 3 (``Init``,
``GatheredParameters``, ``register_external_parameter``, ``unregister_external_parameter``,
``ZeroParamStatus``, ``is_zero_param``).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the ZeRO stage-3 plugin's
``api`` module); they are resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
