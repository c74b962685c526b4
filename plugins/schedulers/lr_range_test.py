"""LRRangeTest: grow the lr linearly from ``lr_range_test_min_lr`` to find where training diverges.

With ``p = last_batch_iteration + 1`` (``p = 0`` before the first ``step()``), ``S =
lr_range_test_step_size`` and ``r = lr_range_test_step_rate``, each param group's lr is::

    lr = lr_range_test_min_lr * (1 + r * k),   k = p / S          (continuous, the default)
                                               k = floor(p / S)   (lr_range_test_staircase)

so the lr grows by ``r * lr_range_test_min_lr`` every ``S`` batches, either smoothly or in
steps held for ``S`` batches.
"""
from __future__ import annotations

from typing import List, Union

from dsplug import PluginSpec
from dsplug.config.schema import MAX_LR, field, schema

from ._common import LRSchedule, build, non_negative, non_negative_number, per_group, whole_steps

Value = Union[float, List[float]]


class LRRangeTest(LRSchedule):
    """Learning-rate range test: lr rises linearly (or in stairs) from ``lr_range_test_min_lr``."""

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr: Value = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group(lr_range_test_min_lr, self.num_groups, "lr_range_test_min_lr")
        self.step_size = whole_steps(lr_range_test_step_size, "lr_range_test_step_size", 1)
        self.step_rate = non_negative_number(lr_range_test_step_rate, "lr_range_test_step_rate")
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def intervals(self, iteration: int) -> float:
        """``k``: how many step sizes have passed (whole ones only with staircase)."""
        position = iteration + 1
        if self.staircase:
            return float(position // self.step_size)
        return position / self.step_size

    def lr_at(self, iteration: int) -> List[float]:
        factor = 1.0 + self.step_rate * self.intervals(iteration)
        return [lo * factor for lo in self.min_lrs]


@schema
class LRRangeTestParams:
    """``scheduler.params`` of LRRangeTest."""

    lr_range_test_min_lr: Value = field(1e-3, le=MAX_LR, check=non_negative, doc="initial lr (one number, or one per param group; <= 1e6)")
    lr_range_test_step_size: int = field(2000, ge=1, doc="batches per increase of the lr")
    lr_range_test_step_rate: float = field(1.0, ge=0, le=MAX_LR, doc="lr grows by this times lr_range_test_min_lr per step size "
                                            "(<= 1e6: a larger rate overflows the lr within a few steps)")
    lr_range_test_staircase: bool = field(False, doc="true: change the lr every step size; false: every batch")
    last_batch_iteration: int = field(-1, ge=-1, doc="index of the last batch already trained (-1: start from the beginning)")


def build_lr_range_test(optimizer, config, context=None) -> LRRangeTest:
    return build(LRRangeTest, LRRangeTestParams, optimizer, config)


def specs():
    """This module's scheduler specs (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="scheduler",
            name="LRRangeTest",
            factory=build_lr_range_test,
            schema=LRRangeTestParams,
            summary="LR range test: lr grows linearly (or in stairs) from lr_range_test_min_lr",
        )
    ]


__all__ = ["LRRangeTest", "LRRangeTestParams"]
