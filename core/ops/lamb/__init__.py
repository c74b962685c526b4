"""``deepspeed.ops.lamb`` names: ``FusedLamb``.

``FusedLamb`` is the Lamb optimizer plugin's class: the plugin declares this path through the
``dsplug_api_modules`` hook and the name is resolved on first use through the registry (so a
blocked or missing plugin is named in the ImportError).
"""
from __future__ import annotations

from dsplug.public import forward_to_plugin

__all__ = ["FusedLamb"]

__getattr__, __dir__ = forward_to_plugin(__name__)
