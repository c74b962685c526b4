"""DeepSpeed's ``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is dsplug's :class:`~dsplug.engine.Engine`
(scripts check ``isinstance(model, DeepSpeedEngine)``)."""
from __future__ import annotations

from ..engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
