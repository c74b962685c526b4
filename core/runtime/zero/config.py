"""DeepSpeed's ``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, ``ZeroStageEnum``,
``DeepSpeedZeroOffloadParamConfig``, ``DeepSpeedZeroOffloadOptimizerConfig``,
``OffloadDeviceEnum``.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the ZeRO plugin, which owns the ``zero_optimization``
schema these models parse with); they are resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
