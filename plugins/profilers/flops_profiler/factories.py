"""The flops profiler spec's factory and DeepSpeed config attribute (cheap: torch is imported when
an observer is built)."""
from __future__ import annotations

from .config import FlopsProfilerConfig


def build_observer(config, context):
    """``factory(config, context)``: an observer profiling one step, or None when not enabled."""
    from dsplug.config.schema import parse

    if config is None:
        return None
    if isinstance(config, dict):
        config = parse(FlopsProfilerConfig, config, "flops_profiler")
    if not config.enabled:
        return None
    from .observer import FlopsProfilerObserver

    return FlopsProfilerObserver(config, context)


def deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attribute of the section: ``flops_profiler_config`` (the
    parsed section, its defaults when absent)."""
    return {"flops_profiler_config": config.section("flops_profiler")}
