"""Registers the built-in LR schedulers (entry point ``schedulers = "dsplug.plugins.schedulers.plugin"``).

Hooks only: each scheduler's spec is built by its feature module, which states its formulas; this
module also declares DeepSpeed's import path ``dsplug.runtime.lr_schedules``
(:mod:`.lr_schedules`).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule
from dsplug.hookspecs import hookimpl

from . import lr_range_test, one_cycle, warmup, warmup_cosine


@hookimpl
def dsplug_schedulers():
    return [*warmup.specs(), *warmup_cosine.specs(), *one_cycle.specs(), *lr_range_test.specs()]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.runtime.lr_schedules", "dsplug.plugins.schedulers.lr_schedules")]
