"""WarmupLR and WarmupDecayLR: warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr``.

With ``t = last_batch_iteration`` (see :mod:`._common`), ``N = max(2, warmup_num_steps)`` and
``T = total_num_steps``, each param group's lr is ``min + (max - min) * gamma(t)`` where::

    warmup, t < N:   gamma = log(t + 1) / log(N)      warmup_type "log"
                     gamma = t / N                    warmup_type "linear"
    WarmupLR, t >= N:       gamma = 1
    WarmupDecayLR, t >= N:  gamma = max(0, (T - t) / max(1, T - N))

``t = -1`` (before the first ``step()``) counts as ``t = 0``, so the first optimizer step runs
at ``warmup_min_lr``. WarmupDecayLR therefore decays linearly from ``warmup_max_lr`` to
``warmup_min_lr`` (0 by default, the usual "decay to zero") at ``t = T`` and stays there.

As in DeepSpeed: ``warmup_num_steps`` below 2 counts as 2 (log(1) = 0 would divide by zero),
``warmup_min_lr`` / ``warmup_max_lr`` may be one number or one per param group. Unlike
DeepSpeed, an unknown ``warmup_type`` is an error instead of a silent switch to "log", and
``total_num_steps < warmup_num_steps`` is an error instead of a logged warning.
"""
from __future__ import annotations

import math
from typing import List, Optional, Union

from dsplug import PluginSpec
from dsplug.config.schema import MAX_LR, field, schema

from ._common import (
    WARMUP_LINEAR_RATE,
    WARMUP_LOG_RATE,
    WARMUP_TYPES,
    LRSchedule,
    build,
    non_negative,
    per_group,
    raise_on,
    read_lr,
    steps_cover_warmup,
    warmup_type_of,
    whole_steps,
    with_cross_field_rule,
)

LrValue = Union[float, List[float]]


def warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """gamma of the warmup phase (1.0 once ``iteration >= warmup_steps``)."""
    t = max(iteration, 0)
    if t >= warmup_steps:
        return 1.0
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


# ------------------------------------------------------------------------------ schedules
class WarmupLR(LRSchedule):
    """lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then holds.

    ``warmup_max_lr=None`` (the class's default, as in DeepSpeed): each param group warms up to the
    lr it has when the schedule is built. (A config's ``scheduler.params`` default stays 0.001.)"""

    def __init__(
        self,
        optimizer,
        warmup_min_lr: LrValue = 0.0,
        warmup_max_lr: Optional[LrValue] = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [read_lr(group) for group in self.optimizer.param_groups]
        self.min_lrs = per_group(warmup_min_lr, self.num_groups, "warmup_min_lr")
        self.max_lrs = per_group(warmup_max_lr, self.num_groups, "warmup_max_lr")
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = max(2, whole_steps(warmup_num_steps, "warmup_num_steps", 0))
        self.warmup_type = warmup_type_of(warmup_type)
        self._apply()

    def gamma(self, iteration: int) -> float:
        """Fraction of the way from ``warmup_min_lr`` to ``warmup_max_lr`` at ``iteration``."""
        return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)

    def lr_at(self, iteration: int) -> List[float]:
        g = self.gamma(iteration)
        return [lo + delta * g for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay back to ``warmup_min_lr`` reached at ``total_num_steps``."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: LrValue = 0.0,
        warmup_max_lr: LrValue = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = whole_steps(total_num_steps, "total_num_steps", 1)
        raise_on(steps_cover_warmup, {"total_num_steps": total_num_steps, "warmup_num_steps": warmup_num_steps})
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


# ------------------------------------------------------------------------------- schemas
_MIN_LR_DOC = "lr at the start of the warmup: one number, or one per param group (each <= 1e6, MAX_LR)"
_MAX_LR_DOC = "lr at the end of the warmup: one number, or one per param group (each <= 1e6, MAX_LR)"
_STEPS_DOC = "optimizer steps to warm up over (values below 2 count as 2)"
_TYPE_DOC = "shape of the warmup: 'log' (fast start) or 'linear'"
_ITER_DOC = "index of the last batch already trained (-1: start from the beginning)"


@schema
class WarmupLRParams:
    """``scheduler.params`` of WarmupLR."""

    warmup_min_lr: LrValue = field(0.0, auto=True, le=MAX_LR, check=non_negative, doc=_MIN_LR_DOC)
    warmup_max_lr: LrValue = field(0.001, auto=True, le=MAX_LR, check=non_negative, doc=_MAX_LR_DOC)
    warmup_num_steps: int = field(1000, ge=0, auto=True, doc=_STEPS_DOC)
    warmup_type: str = field(WARMUP_LOG_RATE, choices=WARMUP_TYPES, case_insensitive=True, doc=_TYPE_DOC)
    last_batch_iteration: int = field(-1, ge=-1, doc=_ITER_DOC)


@with_cross_field_rule(steps_cover_warmup)
@schema
class WarmupDecayLRParams:
    """``scheduler.params`` of WarmupDecayLR."""

    total_num_steps: int = field(ge=1, auto=True, doc="optimizer steps of the whole run; the lr reaches warmup_min_lr here")
    warmup_min_lr: LrValue = field(0.0, auto=True, le=MAX_LR, check=non_negative, doc=_MIN_LR_DOC)
    warmup_max_lr: LrValue = field(0.001, auto=True, le=MAX_LR, check=non_negative, doc=_MAX_LR_DOC)
    warmup_num_steps: int = field(1000, ge=0, auto=True, doc=_STEPS_DOC)
    warmup_type: str = field(WARMUP_LOG_RATE, choices=WARMUP_TYPES, case_insensitive=True, doc=_TYPE_DOC)
    last_batch_iteration: int = field(-1, ge=-1, doc=_ITER_DOC)


# ------------------------------------------------------------------------------- plugin
def build_warmup_lr(optimizer, config, context=None) -> WarmupLR:
    return build(WarmupLR, WarmupLRParams, optimizer, config)


def build_warmup_decay_lr(optimizer, config, context=None) -> WarmupDecayLR:
    return build(WarmupDecayLR, WarmupDecayLRParams, optimizer, config)


def specs():
    """This module's scheduler specs (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="scheduler",
            name="WarmupLR",
            factory=build_warmup_lr,
            schema=WarmupLRParams,
            summary="log or linear warmup from warmup_min_lr to warmup_max_lr, then constant",
        ),
        PluginSpec(
            category="scheduler",
            name="WarmupDecayLR",
            factory=build_warmup_decay_lr,
            schema=WarmupDecayLRParams,
            summary="warmup like WarmupLR, then linear decay to warmup_min_lr at total_num_steps",
        ),
    ]


__all__ = [
    "WarmupLR", "WarmupDecayLR", "WarmupLRParams", "WarmupDecayLRParams",
    "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "warmup_fraction",
]
