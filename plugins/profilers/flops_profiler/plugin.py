"""Registers the flops profiler: it owns the ``flops_profiler`` config section.

Entry point: ``observer-flops-profiler = "dsplug.plugins.profilers.flops_profiler.plugin"``.
Importing this module is cheap; torch is imported when the factory builds an observer. It also
declares DeepSpeed's import paths ``dsplug.profiling.flops_profiler`` (and ``.profiler``), whose
names are this package's public API.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

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


SPEC = PluginSpec(
    category="observer",
    name="flops_profiler",
    section="flops_profiler",
    schema=FlopsProfilerConfig,
    factory=build_observer,
    deepspeed_config=deepspeed_config,
    summary="per-module params, MACs, FLOPs and latency of one training step",
)


@hookimpl
def dsplug_observers():
    return [SPEC]


@hookimpl
def dsplug_api_modules():
    # DeepSpeed's import paths; both hold the same names (the package's lazy exports)
    package = __name__.rsplit(".", 1)[0]
    return [ApiModule("dsplug.profiling.flops_profiler", package),
            ApiModule("dsplug.profiling.flops_profiler.profiler", package)]


@hookimpl
def dsplug_flops_counter(module, accelerator):
    """A :class:`~.profiler.FlopsProfiler` of ``module`` (other plugins count FLOPs through it)."""
    from .profiler import FlopsProfiler

    return FlopsProfiler(module, accelerator=accelerator)
