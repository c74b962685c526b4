"""Registers data efficiency: it owns the ``data_efficiency`` section.

Entry point: ``data-efficiency = "dsplug.plugins.data_efficiency.plugin"``. The engine observer
(curriculum data sampling, random-LTD) and the engine methods are in :mod:`.observer`, the schema
and its rule in :mod:`.config`; this module also declares DeepSpeed's import paths under
``dsplug.runtime.data_pipeline``.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import DataEfficiencyConfig, notice_enabled_but_off
from .observer import SECTION, build_observer, deepspeed_config, engine_methods


@hookimpl
def dsplug_observers():
    return [PluginSpec(
        category="observer",
        name=SECTION,
        section=SECTION,
        schema=DataEfficiencyConfig,
        factory=build_observer,
        deepspeed_config=deepspeed_config,
        rules=[notice_enabled_but_off],
        summary="data efficiency: curriculum data sampling (DataAnalyzer index files) and random-LTD token dropping",
    )]


@hookimpl
def dsplug_engine_methods(engine):
    """DeepSpeed's data-efficiency accessors (on every engine)."""
    return engine_methods(engine)


_API = "dsplug.runtime.data_pipeline"


@hookimpl
def dsplug_api_modules():
    here = "dsplug.plugins.data_efficiency"
    return [ApiModule(f"{_API}.data_sampling.data_analyzer", f"{here}.analyzer"),
            ApiModule(f"{_API}.data_sampling.data_sampler", f"{here}.sampler"),
            ApiModule(f"{_API}.data_routing.basic_layer", f"{here}.random_ltd"),
            ApiModule(f"{_API}.data_routing.helper", f"{here}.random_ltd"),
            ApiModule(f"{_API}.data_routing.scheduler", f"{here}.random_ltd")]
