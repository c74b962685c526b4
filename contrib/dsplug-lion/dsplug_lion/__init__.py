"""Lion optimizer plugin for dsplug.

``Lion`` is imported on first access, so that dsplug's plugin discovery, which imports the entry
point :mod:`dsplug_lion.plugin` (and so this package), does not import torch.
"""

__all__ = ["Lion"]


def __getattr__(name):
    if name == "Lion":
        from .lion import Lion

        return Lion
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
