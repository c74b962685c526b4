"""DeepSpeed's ``deepspeed.utils.timer`` helpers (the engine's step timers are :mod:`dsplug.timers`)."""
from __future__ import annotations

import math
from typing import Sequence


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """The mean of ``data`` without its ``trim_percent`` lowest and highest values (each end loses
    ``int(len(data) * trim_percent)`` values). ``data`` is not modified. ``trim_percent`` in
    [0, 0.5); an empty ``data`` gives 0."""
    if not 0 <= trim_percent < 0.5:
        raise ValueError(f"trim_mean: trim_percent={trim_percent!r} must be in [0, 0.5)")
    ordered = sorted(data)
    if not ordered:
        return 0.0
    k = int(len(ordered) * trim_percent)
    kept = ordered[k:len(ordered) - k]
    return math.fsum(kept) / len(kept)


__all__ = ["trim_mean"]
