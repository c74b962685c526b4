"""OneCycle (also accepted as "1Cycle"): one triangular lr cycle, then decay.

Let ``p = last_batch_iteration + 1`` (``p = 0`` before the first ``step()``), ``S1 =
cycle_first_step_size``, ``S2 = cycle_second_step_size`` (default ``S1``), ``L = S1 + S2``.

Cycle phase, ``p <= L``: a scale ``s`` in [0, 1] rises over the first ``S1`` batches and falls
over the next ``S2``::

    continuous:  s = p / S1                 (p <= S1)
                 s = (L - p) / S2           (p >  S1)
    stairs:      s = floor(p * n1 / S1) / n1           n1 = cycle_first_stair_count > 0
                 s = floor((L - p) * n2 / S2) / n2     n2 = cycle_second_stair_count > 0
                                                       (default n2 = n1; a count of 0 = continuous)

    lr       = cycle_min_lr  + (cycle_max_lr  - cycle_min_lr)  * s
    momentum = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * s     (inverse to the lr)

so the lr starts at ``cycle_min_lr``, peaks at ``cycle_max_lr`` at ``p = S1`` and is back at
``cycle_min_lr`` at ``p = L``, while momentum goes max -> min -> max.

Decay phase, ``p > L``, with ``d = (p - L) / decay_step_size`` (a continuous count of decay
intervals, as DeepSpeed computes it)::

    lr       = cycle_min_lr / (1 + decay_lr_rate * d)
    momentum = cycle_max_mom * (1 + decay_mom_rate * d)

and ``decay_step_size = 0`` (the default) holds lr at ``cycle_min_lr`` and momentum at
``cycle_max_mom``. Note that, as in DeepSpeed, a positive ``decay_mom_rate`` *raises* momentum.

Momentum (``cycle_momentum``, on by default) drives Adam-style param groups as DeepSpeed does:
``betas = (momentum, 0.99)`` (``betas[1]`` becomes 0.99 whatever was configured), written from the
start: a new schedule (``last_batch_iteration = -1``) writes ``betas = (cycle_min_mom, 0.99)``
before the first ``step()`` (then ``get_mom()`` still reports the formula's value at ``p = 0``,
``(cycle_max_mom, 0.99)``, as DeepSpeed's does: one ``(momentum, 0.99)`` pair per group), and each ``step()`` the formula's value. These numbers
equal DeepSpeed 0.19.8's (tests/data/deepspeed/one_cycle.json). SGD-style groups get the cycled
value as ``momentum``, a dsplug extension: DeepSpeed's OneCycle silently leaves an optimizer without
``betas`` alone (lr-only cycling). An optimizer with neither gets a warning and lr-only cycling.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Union

from dsplug import PluginSpec
from dsplug.config.schema import MAX_LR, field, schema

from ._common import (
    LRSchedule,
    all_rules,
    build,
    momentum_key,
    non_negative,
    non_negative_number,
    ordered_pair,
    per_group,
    raise_on,
    whole_steps,
    with_cross_field_rule,
    write_momenta,
)

Value = Union[float, List[float]]

#: ``betas[1]`` of Adam-style groups while OneCycle cycles their ``betas[0]`` (DeepSpeed's value)
CYCLE_BETA2 = 0.99

_one_cycle_rule = all_rules(
    ordered_pair("cycle_min_lr", "cycle_max_lr"),
    ordered_pair("cycle_min_mom", "cycle_max_mom"),
)


def momentum_in_range(value) -> Optional[str]:
    """Schema ``check``: a momentum (or one per param group) in [0, 1)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        return "must be a number, or a non-empty list with one number per parameter group"
    for v in values:
        if not 0 <= v < 1:
            return f"momentum must be in [0, 1) (got {v!r})"
    return None


class OneCycle(LRSchedule):
    """1Cycle policy: lr up then down between ``cycle_min_lr`` and ``cycle_max_lr`` (momentum
    the other way), then an optional decay. See the module docstring for the formulas."""

    def __init__(
        self,
        optimizer,
        cycle_min_lr: Value,
        cycle_max_lr: Value,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: Optional[int] = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: Optional[int] = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: Value = 0.8,
        cycle_max_mom: Value = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        n = self.num_groups
        self.min_lrs = per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = per_group(cycle_max_lr, n, "cycle_max_lr")
        self.decay_lr_rate = non_negative_number(decay_lr_rate, "decay_lr_rate")
        self.first_step_size = whole_steps(cycle_first_step_size, "cycle_first_step_size", 1)
        self.second_step_size = (
            self.first_step_size if cycle_second_step_size is None
            else whole_steps(cycle_second_step_size, "cycle_second_step_size", 0)
        )  # 0 (as DeepSpeed allows): the lr drops back to cycle_min_lr right after the peak
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = whole_steps(cycle_first_stair_count, "cycle_first_stair_count", 0)
        self.second_stair_count = (
            self.first_stair_count if cycle_second_stair_count is None
            else whole_steps(cycle_second_stair_count, "cycle_second_stair_count", 0)
        )
        self.decay_step_size = whole_steps(decay_step_size, "decay_step_size", 0)
        self.min_moms = per_group(cycle_min_mom, n, "cycle_min_mom")
        self.max_moms = per_group(cycle_max_mom, n, "cycle_max_mom")
        if not isinstance(decay_mom_rate, (int, float)) or isinstance(decay_mom_rate, bool):
            raise ValueError(f"decay_mom_rate must be a number, got {decay_mom_rate!r}")
        self.decay_mom_rate = float(decay_mom_rate)
        raise_on(_one_cycle_rule, {"cycle_min_lr": cycle_min_lr, "cycle_max_lr": cycle_max_lr,
                                   "cycle_min_mom": cycle_min_mom, "cycle_max_mom": cycle_max_mom})
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and any(momentum_key(g) is None for g in self.optimizer.param_groups):
            warnings.warn(
                f"OneCycle: cycle_momentum is disabled because {type(self.optimizer).__name__} has "
                "param groups with neither 'betas' nor 'momentum'; only the lr is cycled",
                UserWarning,
                stacklevel=2,
            )
            self.cycle_momentum = False
        self._apply()

    @property
    def step_ratio(self) -> float:
        """The rising half's share of the cycle, ``S1 / L`` (DeepSpeed's attribute)."""
        return self.first_step_size / self.total_size

    # ----------------------------------------------------------------------- formulas
    def cycle_scale(self, position: int) -> float:
        """``s`` in [0, 1] at batch ``position`` (``0 <= position <= total_size``)."""
        if position <= self.first_step_size:
            stairs, done, size = self.first_stair_count, position, self.first_step_size
        else:
            stairs, done, size = self.second_stair_count, self.total_size - position, self.second_step_size
        if stairs > 0:
            return (done * stairs // size) / stairs
        return done / size

    def _decay_intervals(self, position: int) -> Optional[float]:
        if self.decay_step_size == 0:
            return None
        return (position - self.total_size) / self.decay_step_size

    def lr_at(self, iteration: int) -> List[float]:
        position = iteration + 1
        if position <= self.total_size:
            s = self.cycle_scale(position)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        d = self._decay_intervals(position)
        if d is None:
            return list(self.min_lrs)
        return [lo / (1.0 + self.decay_lr_rate * d) for lo in self.min_lrs]

    def momentum_at(self, iteration: int) -> Optional[List[float]]:
        if not self.cycle_momentum:
            return None
        position = iteration + 1
        if position <= self.total_size:
            s = self.cycle_scale(position)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        d = self._decay_intervals(position)
        if d is None:
            return list(self.max_moms)
        return [hi * (1.0 + self.decay_mom_rate * d) for hi in self.max_moms]

    def get_mom(self) -> Optional[List[tuple]]:
        """DeepSpeed's shape: ``(momentum, 0.99)`` per group for the current iteration, the pair
        written as ``betas`` to Adam-style groups (SGD-style groups get the first value as
        ``momentum``); None when not cycling momentum. :meth:`momentum_at` gives the bare values."""
        momenta = self.momentum_at(self.last_batch_iteration)
        return None if momenta is None else [(m, CYCLE_BETA2) for m in momenta]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            # a new schedule starts the optimizer at the lowest momentum, as DeepSpeed's does
            momenta = (list(self.min_moms) if self.last_batch_iteration == -1
                      else self.momentum_at(self.last_batch_iteration))
            write_momenta(self.optimizer.param_groups, momenta, beta2=CYCLE_BETA2)


@with_cross_field_rule(_one_cycle_rule)
@schema
class OneCycleParams:
    """``scheduler.params`` of OneCycle."""

    cycle_min_lr: Value = field(le=MAX_LR, check=non_negative, doc="lr at the start and end of the cycle (one number, or one per param group; <= 1e6)")
    cycle_max_lr: Value = field(le=MAX_LR, check=non_negative, doc="lr at the peak of the cycle (one number, or one per param group; <= 1e6)")
    decay_lr_rate: float = field(0.0, ge=0, doc="after the cycle: lr = cycle_min_lr / (1 + decay_lr_rate * intervals)")
    cycle_first_step_size: int = field(2000, ge=1, doc="batches of the rising half of the cycle")
    cycle_second_step_size: Optional[int] = field(None, ge=0, doc="batches of the falling half (default: "
                                                  "cycle_first_step_size; 0: straight back to cycle_min_lr)")
    cycle_first_stair_count: int = field(0, ge=0, doc="stairs in the rising half (0: change every batch)")
    cycle_second_stair_count: Optional[int] = field(None, ge=0, doc="stairs in the falling half (default: cycle_first_stair_count)")
    decay_step_size: int = field(0, ge=0, doc="batches per decay interval after the cycle (0: no decay)")
    cycle_momentum: bool = field(True, doc="cycle momentum (betas[0] or momentum) inversely to the lr")
    cycle_min_mom: Value = field(0.8, check=momentum_in_range, doc="momentum at the lr peak")
    cycle_max_mom: Value = field(0.9, check=momentum_in_range, doc="momentum at the start and end of the cycle")
    decay_mom_rate: float = field(0.0, doc="after the cycle: momentum = cycle_max_mom * (1 + decay_mom_rate * intervals)")
    last_batch_iteration: int = field(-1, ge=-1, doc="index of the last batch already trained (-1: start from the beginning)")


def build_one_cycle(optimizer, config, context=None) -> OneCycle:
    return build(OneCycle, OneCycleParams, optimizer, config)


def specs():
    """This module's scheduler specs (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="scheduler",
            name="OneCycle",
            aliases=("1Cycle",),
            factory=build_one_cycle,
            schema=OneCycleParams,
            summary="1Cycle: lr up/down between cycle_min_lr and cycle_max_lr, momentum inverse, then decay",
        )
    ]


__all__ = ["OneCycle", "OneCycleParams"]
