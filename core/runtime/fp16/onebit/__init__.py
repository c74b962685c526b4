"""``dsplug.runtime.fp16.onebit`` (DeepSpeed's ``deepspeed.runtime.fp16.onebit``): the 1-bit
optimizers ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb``; the submodules ``adam``,
``zoadam`` and ``lamb`` hold one each, as in DeepSpeed.

The names come from the installed plugin that declares these paths through the
``dsplug_api_modules`` hook (dsplug's own: ``dsplug.plugins.onebit``); they are resolved on first
use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
