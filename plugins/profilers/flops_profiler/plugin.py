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
from .factories import build_observer, deepspeed_config


@hookimpl
def dsplug_observers():
    return [PluginSpec(
        category="observer",
        name="flops_profiler",
        section="flops_profiler",
        schema=FlopsProfilerConfig,
        factory=build_observer,
        deepspeed_config=deepspeed_config,
        summary="per-module params, MACs, FLOPs and latency of one training step",
    )]


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
