"""Lion optimizer plugin for dsplug."""
from .lion import Lion

__all__ = ["Lion"]
