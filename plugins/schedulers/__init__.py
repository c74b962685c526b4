"""Built-in LR schedulers, selected by ``scheduler.type`` (case-insensitive).

=================  ======================================  =================================
name               module                                  shape
=================  ======================================  =================================
WarmupLR           :mod:`.warmup`                          log / linear warmup, then constant
WarmupDecayLR      :mod:`.warmup`                          warmup, then linear decay
WarmupCosineLR     :mod:`.warmup_cosine`                   warmup, then cosine (ratios of lr)
OneCycle, 1Cycle   :mod:`.one_cycle`                       one lr/momentum cycle, then decay
LRRangeTest        :mod:`.lr_range_test`                   linear or staircase lr growth
=================  ======================================  =================================

Each module registers through its own entry point and states its formulas in its docstring.
This package (entry point ``schedulers``) declares DeepSpeed's import path
``dsplug.runtime.lr_schedules``, provided by :mod:`.lr_schedules`.
"""
from dsplug.descriptors import ApiModule
from dsplug.hookspecs import hookimpl

from .lr_range_test import LRRangeTest
from .one_cycle import OneCycle
from .warmup import WarmupDecayLR, WarmupLR
from .warmup_cosine import WarmupCosineLR

__all__ = ["LRRangeTest", "OneCycle", "WarmupDecayLR", "WarmupLR", "WarmupCosineLR"]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.runtime.lr_schedules", f"{__name__}.lr_schedules")]
