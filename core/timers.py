"""Wall-clock timers for forward / backward / step (``wall_clock_breakdown``)."""
from __future__ import annotations

import time
from typing import Dict


class StepTimers:
    """Accumulates milliseconds per phase since the last :meth:`collect`; free when disabled."""

    def __init__(self, accelerator, enabled: bool):
        self.accelerator = accelerator
        self.enabled = enabled
        self._started: Dict[str, float] = {}
        self._totals: Dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            self.accelerator.synchronize()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._started:
            self.accelerator.synchronize()
            elapsed = (time.perf_counter() - self._started.pop(name)) * 1000.0
            self._totals[name] = self._totals.get(name, 0.0) + elapsed

    def collect(self) -> Dict[str, float]:
        totals, self._totals = self._totals, {}
        return totals
