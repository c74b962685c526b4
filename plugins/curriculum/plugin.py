"""Registers legacy curriculum learning: it owns the top-level ``curriculum_learning`` section.

Entry point: ``observer-curriculum-learning = "dsplug.plugins.curriculum.plugin"``. What the
observer does, and the engine methods and DeepSpeed config attributes it adds, are in
:mod:`.observer`; the schedule in :mod:`.scheduler`, the schema in :mod:`.config`.
"""
from __future__ import annotations

from dsplug.descriptors import PluginSpec
from dsplug.hookspecs import hookimpl

from .config import LegacyCurriculumConfig
from .observer import SECTION, build_observer, deepspeed_config, engine_methods


@hookimpl
def dsplug_engine_methods(engine):
    """DeepSpeed's engine accessors of the legacy curriculum (present on every engine)."""
    return engine_methods(engine)


@hookimpl
def dsplug_observers():
    return [PluginSpec(
        category="observer",
        name=SECTION,
        section=SECTION,
        schema=LegacyCurriculumConfig,
        factory=build_observer,
        deepspeed_config=deepspeed_config,
        summary="legacy curriculum learning: curriculum_seqlen per global step (fixed_linear / fixed_root / "
                "fixed_discrete)",
    )]
