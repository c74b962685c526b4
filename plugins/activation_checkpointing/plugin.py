"""Registers activation checkpointing: the ``activation_checkpointing`` section's observer, DeepSpeed's
``deepspeed.checkpointing`` import paths and the pipeline's default checkpoint function.

Entry point: ``observer-activation-checkpointing = "dsplug.plugins.activation_checkpointing.plugin"``.
Importing this module is cheap (no torch).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import ActivationCheckpointingConfig

API_MODULE = "dsplug.plugins.activation_checkpointing.checkpointing"


def _build_observer(section, context):
    """``factory(section, context)``: the engine's observer for its ``activation_checkpointing`` section."""
    from .observer import ActivationCheckpointingObserver

    return ActivationCheckpointingObserver(section, context)


@hookimpl
def dsplug_observers():
    return [PluginSpec(
        category="observer",
        name="activation_checkpointing",
        section="activation_checkpointing",
        schema=ActivationCheckpointingConfig,
        factory=_build_observer,
        summary="deepspeed.checkpointing: recompute activations in backward (partitioned, CPU, contiguous), "
                "configured from this section",
    )]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.checkpointing", API_MODULE),
            ApiModule("dsplug.runtime.activation_checkpointing.checkpointing", API_MODULE)]


@hookimpl
def dsplug_activation_checkpoint_function():
    """:func:`.checkpointing.checkpoint` (the pipeline's default ``activation_checkpoint_func``)."""
    from .checkpointing import checkpoint

    return checkpoint
