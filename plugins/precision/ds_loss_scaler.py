"""DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler`` API over this plugin's loss scalers
(:mod:`.loss_scaler`); the kernel's ``dsplug.runtime.fp16.loss_scaler`` forwards here.

The classes take DeepSpeed's constructor arguments (``init_scale`` is the scale itself, not a
power of two; ``delayed_shift`` is the hysteresis) and answer its attribute names (``cur_scale``,
``loss_scale``, ``cur_iter``, ``cur_hysteresis`` ...); the scaling rules are the precision
plugin's, which the fp16 mode trains with.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from .loss_scaler import DynamicScaler as _Dynamic
from .loss_scaler import StaticScaler as _Static

INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def to_python_float(t) -> float:
    return float(t.item()) if torch.is_tensor(t) else float(t)


class _DeepSpeedNames:
    """DeepSpeed's attribute and method names on top of a scaler with ``scale`` and ``update``."""

    @property
    def cur_scale(self) -> float:
        return self.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scale = float(value)

    @property
    def loss_scale(self) -> float:
        return self.scale

    def update_scale(self, overflow: bool) -> None:
        self.update(bool(overflow))

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, j=None) -> bool:
        value = float(x.float().sum())
        return math.isinf(value) or math.isnan(value)

    def has_overflow_serial(self, params: Iterable) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad.data) for p in params)

    def has_overflow(self, params: Iterable, has_moe_params=None) -> bool:
        return self.has_overflow_serial(params) if self.dynamic else False


class LossScalerBase(_DeepSpeedNames, _Static):
    """A scaler holding ``cur_scale``; ``update_scale`` does nothing."""

    def __init__(self, cur_scale: float):
        _Static.__init__(self, cur_scale)


class LossScaler(LossScalerBase):
    """A static loss scale (DeepSpeed's ``LossScaler(scale=1)``): never reports an overflow."""

    def __init__(self, scale: float = 1):
        super().__init__(scale)

    def has_overflow(self, params: Iterable, has_moe_params=None) -> bool:
        return False


class DynamicLossScaler(_DeepSpeedNames, _Dynamic):
    """Dynamic loss scaling with DeepSpeed's constructor: halve on overflow once ``delayed_shift``
    overflows were spent (not below ``min_scale``; at ``min_scale`` with
    ``raise_error_at_min_scale`` an overflow is an error), multiply by ``scale_factor`` after
    ``scale_window`` overflow-free iterations."""

    def __init__(self, init_scale: float = 2 ** 32, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1, delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True, dtype: Optional[torch.dtype] = torch.half):
        _Dynamic.__init__(self, initial_scale_power=0, scale_window=scale_window, hysteresis=delayed_shift,
                          consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                          scale_factor=scale_factor)
        self.scale = float(init_scale)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.dtype = dtype

    # DeepSpeed's names for the plugin scaler's counters
    delayed_shift = property(lambda self: self.hysteresis)
    cur_iter = property(lambda self: self.iteration)
    last_overflow_iter = property(lambda self: self.last_overflow_iteration)
    cur_hysteresis = property(lambda self: self.remaining_hysteresis)

    def update(self, overflow: bool) -> None:
        halves = overflow and (self.hysteresis == 1 or self.remaining_hysteresis == 1)
        if halves and self.scale == self.min_scale and self.raise_error_at_min_scale:
            raise RuntimeError("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
        super().update(overflow)


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling: bool, dynamic_loss_args=None):
    """DeepSpeed's factory: a dynamic scaler for fp16 with ``dynamic_scaling``, else a static one
    (scale ``static_loss_scale`` for fp16, 1 otherwise)."""
    if dtype == torch.half and dynamic_scaling:
        return DynamicLossScaler(dtype=dtype, **(dynamic_loss_args or {}))
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


__all__ = ["CONSECUTIVE_HYSTERESIS", "CreateLossScaler", "DELAYED_SHIFT", "DynamicLossScaler", "INITIAL_LOSS_SCALE",
           "LossScaler", "LossScalerBase", "MIN_LOSS_SCALE", "SCALE_WINDOW", "to_python_float"]
