"""Registers autotuning: the ``autotuning`` section's observer, ``dsplug launch --autotuning`` and
DeepSpeed's import paths ``dsplug.autotuning`` (:mod:`.api`) and its ``.autotuner``, ``.scheduler``
and ``.utils`` submodules.

Entry point: ``autotuning = "dsplug.plugins.autotuning.plugin"``. Cheap to import (no torch).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import AutotuningConfig


def _build_observer(section, context):
    from .observer import build_observer as build

    return build(section, context)


@hookimpl
def dsplug_observers():
    return [PluginSpec(category="observer", name="autotuning", section="autotuning", schema=AutotuningConfig,
                       factory=_build_observer,
                       summary="autotuning experiments: measures latency / throughput / FLOPS between the profile "
                               "steps (dsplug launch --autotuning tune|run)")]


@hookimpl
def dsplug_api_modules():
    """``dsplug.autotuning`` (:mod:`.api`) and DeepSpeed's submodules ``.autotuner`` (``Autotuner``),
    ``.scheduler`` (``ResourceManager``) and ``.utils`` (``get_val_by_key``, ``set_val_by_key``)."""
    return [ApiModule("dsplug.autotuning", "dsplug.plugins.autotuning.api"),
            ApiModule("dsplug.autotuning.autotuner", "dsplug.plugins.autotuning.autotuner"),
            ApiModule("dsplug.autotuning.scheduler", "dsplug.plugins.autotuning.scheduler"),
            ApiModule("dsplug.autotuning.utils", "dsplug.plugins.autotuning.utils")]


@hookimpl
def dsplug_launch_override(args, resources):
    """``dsplug launch --autotuning tune|run``: tune (and then train) instead of one launch."""
    if not getattr(args, "autotuning", ""):
        return None
    from .autotuner import run_autotuning

    return run_autotuning(args, resources)
