"""DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler``: ``LossScaler`` (a static scale),
``DynamicLossScaler``, ``LossScalerBase``, ``CreateLossScaler`` and the dynamic-scaling argument
names (``INITIAL_LOSS_SCALE``, ``SCALE_WINDOW``, ``DELAYED_SHIFT``, ``CONSECUTIVE_HYSTERESIS``,
``MIN_LOSS_SCALE``), with DeepSpeed's constructors.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the precision plugin, whose fp16 mode scales with the
same rules); they are resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
