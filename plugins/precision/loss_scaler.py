"""Loss scaling for fp16, with DeepSpeed's dynamic-scaling semantics.

Dynamic scaling: start at ``2**initial_scale_power``. On an overflow, spend one unit of
hysteresis; when none is left (or hysteresis is 1), halve the scale (not below
``min_loss_scale``). After ``loss_scale_window`` iterations without overflow since the last one,
double the scale and refill the hysteresis. ``consecutive_hysteresis`` refills the hysteresis on
every iteration without overflow instead of only when the scale grows.
"""
from __future__ import annotations


class StaticScaler:
    """A fixed loss scale (``fp16.loss_scale`` > 0, or amp with a number)."""

    dynamic = False

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])


class DynamicScaler:
    """The dynamic loss scale described above (DeepSpeed's API names over it: :mod:`.ds_loss_scaler`)."""

    dynamic = True

    def __init__(self, initial_scale_power: int = 16, scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, scale_factor: float = 2.0,
                 max_scale: float = float("inf")):
        self.scale = float(2 ** initial_scale_power)
        self.scale_window = int(scale_window)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.max_scale = float(max_scale)
        self.remaining_hysteresis = self.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.remaining_hysteresis == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.remaining_hysteresis -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.remaining_hysteresis = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.remaining_hysteresis = self.hysteresis
                self.scale = min(self.scale * self.scale_factor, self.max_scale)
        self.iteration += 1

    def state_dict(self):
        return {"scale": self.scale, "remaining_hysteresis": self.remaining_hysteresis,
                "iteration": self.iteration, "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.remaining_hysteresis = int(state["remaining_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
