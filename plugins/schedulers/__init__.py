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

Each module states its formulas in its docstring and builds its specs; :mod:`.plugin` (entry point
``schedulers``) registers them all and declares DeepSpeed's import path
``dsplug.runtime.lr_schedules``, provided by :mod:`.lr_schedules`.
"""
