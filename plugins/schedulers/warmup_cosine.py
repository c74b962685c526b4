"""WarmupCosineLR: warmup, then cosine decay, as ratios of the optimizer's own lr.

The base lr of each param group is the optimizer's lr when the schedule is built (it is saved
in ``state_dict()`` as ``base_lrs``, so a resumed run keeps it even if the optimizer state it
is built on was already scheduled). With ``t = last_batch_iteration`` (see :mod:`._common`),
``N = max(2, warmup_num_steps)``, ``T = total_num_steps``, ``w = warmup_min_ratio`` and
``c = cos_min_ratio``, each group's lr is ``base_lr * ratio(t)``::

    warmup, t < N:  ratio = w + (1 - w) * f(t),  f = log(t + 1) / log(N)  ("log")
                                                  f = t / N               ("linear")
    after, t >= N:  p = min(1, (t - N + 1) / max(1, T - N))
                    ratio = max(0, c + (1 - c) * (1 + cos(pi * p)) / 2)

so the ratio reaches ``c`` at ``t = T - 1`` (the last of ``T`` steps) and stays there: the
progress ``p`` is clamped at 1 rather than letting the cosine climb back up after
``total_num_steps``. ``t = -1`` counts as ``t = 0``: the first optimizer step runs at
``w * base_lr`` (DeepSpeed writes lr 0 before the first ``step()``; the two agree for the
default ``w = 0``).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

from dsplug import PluginSpec
from dsplug.config.schema import field, schema

from ._common import (
    WARMUP_LOG_RATE,
    WARMUP_TYPES,
    LRSchedule,
    build,
    non_negative_number,
    raise_on,
    read_lr,
    steps_cover_warmup,
    warmup_type_of,
    whole_steps,
    with_cross_field_rule,
)
from .warmup import warmup_fraction


class WarmupCosineLR(LRSchedule):
    """lr = base lr x a ratio that warms up from ``warmup_min_ratio`` to 1, then follows a
    half cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = whole_steps(total_num_steps, "total_num_steps", 1)
        raise_on(steps_cover_warmup, {"total_num_steps": total_num_steps, "warmup_num_steps": warmup_num_steps})
        self.warmup_num_steps = max(2, whole_steps(warmup_num_steps, "warmup_num_steps", 0))
        self.warmup_min_ratio = non_negative_number(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = non_negative_number(cos_min_ratio, "cos_min_ratio")
        self.warmup_type = warmup_type_of(warmup_type)
        self.base_lrs = [read_lr(group) for group in self.optimizer.param_groups]
        self._apply()

    def lr_ratio_at(self, iteration: int) -> float:
        t = max(iteration, 0)
        if t < self.warmup_num_steps:
            f = warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * f
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """The ratio for the current ``last_batch_iteration`` (DeepSpeed's name)."""
        return self.lr_ratio_at(self.last_batch_iteration)

    def lr_at(self, iteration: int) -> List[float]:
        ratio = self.lr_ratio_at(iteration)
        return [base * ratio for base in self.base_lrs]

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        base_lrs = state_dict.get("base_lrs") if isinstance(state_dict, dict) else None
        if base_lrs is not None:
            if len(base_lrs) != self.num_groups:
                raise ValueError(
                    f"WarmupCosineLR.load_state_dict: the saved state has {len(base_lrs)} base lrs "
                    f"but the optimizer has {self.num_groups} parameter group(s)"
                )
            self.base_lrs = [float(v) for v in base_lrs]
        super().load_state_dict(state_dict)


@with_cross_field_rule(steps_cover_warmup)
@schema
class WarmupCosineLRParams:
    """``scheduler.params`` of WarmupCosineLR."""

    total_num_steps: int = field(ge=1, auto=True, doc="optimizer steps of the whole run; the ratio reaches cos_min_ratio here")
    warmup_min_ratio: float = field(0.0, ge=0, le=1.0, doc="lr ratio (of the optimizer's lr) at the start of the warmup "
                                    "(0..1: the warmup rises from it to the optimizer's lr)")
    warmup_num_steps: int = field(1000, ge=0, auto=True, doc="optimizer steps to warm up over (values below 2 count as 2)")
    cos_min_ratio: float = field(0.0001, ge=0, le=1.0, doc="lr ratio at the end of the cosine decay (0..1: the decay "
                                 "falls from the optimizer's lr to it)")
    warmup_type: str = field(WARMUP_LOG_RATE, choices=WARMUP_TYPES, case_insensitive=True,
                             doc="shape of the warmup: 'log' (fast start) or 'linear'")
    last_batch_iteration: int = field(-1, ge=-1, doc="index of the last batch already trained (-1: start from the beginning)")


def build_warmup_cosine_lr(optimizer, config, context=None) -> WarmupCosineLR:
    return build(WarmupCosineLR, WarmupCosineLRParams, optimizer, config)


def specs():
    """This module's scheduler specs (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="scheduler",
            name="WarmupCosineLR",
            factory=build_warmup_cosine_lr,
            schema=WarmupCosineLRParams,
            summary="warmup then cosine decay, as ratios of the optimizer's lr",
        )
    ]


__all__ = ["WarmupCosineLR", "WarmupCosineLRParams"]
