"""Registers pipeline parallelism through two service hooks: ``dsplug_api_modules`` (DeepSpeed's
import paths) and ``dsplug_engine_factory`` (``initialize`` builds a ``PipelineEngine`` for a
``PipelineModule``).

Entry point: ``pipe = "dsplug.plugins.pipe.plugin"``. Importing this module is cheap (no torch).
"""
from __future__ import annotations

import sys

from dsplug.descriptors import ApiModule
from dsplug.hookspecs import hookimpl


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.pipe", "dsplug.plugins.pipe.api"),
            ApiModule("dsplug.runtime.pipe", "dsplug.plugins.pipe.api"),
            ApiModule("dsplug.runtime.pipe.module", "dsplug.plugins.pipe.module"),
            ApiModule("dsplug.runtime.pipe.topology", "dsplug.plugins.pipe.topology"),
            ApiModule("dsplug.runtime.pipe.engine", "dsplug.plugins.pipe.engine"),
            ApiModule("dsplug.runtime.pipe.schedule", "dsplug.plugins.pipe.schedule")]


@hookimpl
def dsplug_engine_factory(model, mpu):
    """A ``PipelineModule`` is trained by the ``PipelineEngine`` (the module cannot be one unless
    its module was imported, so nothing is imported for other models)."""
    module = sys.modules.get("dsplug.plugins.pipe.module")
    if module is None or not isinstance(model, module.PipelineModule):
        return None
    from .engine import PipelineEngine

    return PipelineEngine
