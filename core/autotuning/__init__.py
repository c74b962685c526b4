"""``dsplug.autotuning``: DeepSpeed's ``deepspeed.autotuning`` (``Autotuner``, the tuners, the
``autotuning`` section's schema, ``add_tuning_arguments``).

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the autotuning plugin); they are resolved on first use
(see :mod:`dsplug.public`). The tuner itself runs as ``dsplug launch --autotuning tune|run``.
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
