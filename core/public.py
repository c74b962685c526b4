"""DeepSpeed import paths whose names a plugin provides (``dsplug.zero``, ``dsplug.runtime.lr_schedules``).

The kernel keeps a thin module at each such path so ``import dsplug.zero`` works as in DeepSpeed,
but the names in it come from whichever installed plugin declares the path through the
``dsplug_api_modules`` hook. Resolution happens on first attribute access, through the registry,
so ``DSPLUG_BLOCK_PLUGINS`` applies and a blocked or missing plugin is named in the error::

    # core/zero/__init__.py
    from dsplug.public import forward_to_plugin
    __getattr__, __dir__ = forward_to_plugin(__name__)
"""
from __future__ import annotations

import sys
from typing import Callable, List, Tuple


def forward_to_plugin(module_name: str) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for the kernel module ``module_name`` (PEP 562)."""

    def target():
        from .registry import get_registry

        return get_registry().api_module(module_name)

    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        provider = target()
        try:
            value = getattr(provider, name)
        except AttributeError:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r} "
                                 f"(its names come from {provider.__name__})") from None
        setattr(sys.modules[module_name], name, value)  # later lookups skip the registry
        return value

    def __dir__() -> List[str]:
        return sorted(n for n in dir(target()) if not n.startswith("_"))

    return __getattr__, __dir__
