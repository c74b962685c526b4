"""Registers progressive layer dropping (PLD): it owns the ``progressive_layer_drop`` section.

Entry point: ``observer-progressive-layer-drop = "dsplug.plugins.progressive_layer_drop.plugin"``.
The schedule, the observer and the engine methods are in :mod:`.observer`, the schema in
:mod:`.config`.
"""
from __future__ import annotations

from dsplug.descriptors import PluginSpec
from dsplug.hookspecs import hookimpl

from .config import ProgressiveLayerDropConfig
from .observer import SECTION, build_observer, deepspeed_config, engine_methods


@hookimpl
def dsplug_engine_methods(engine):
    """DeepSpeed's engine accessors of PLD (present on every engine)."""
    return engine_methods(engine)


@hookimpl
def dsplug_observers():
    return [PluginSpec(
        category="observer",
        name=SECTION,
        section=SECTION,
        schema=ProgressiveLayerDropConfig,
        factory=build_observer,
        deepspeed_config=deepspeed_config,
        summary="progressive layer dropping: progressive_layer_drop / pld_theta to the model's forward",
    )]
