"""Activation checkpointing: DeepSpeed's ``deepspeed.checkpointing`` API and the
``activation_checkpointing`` config section.

* :mod:`.checkpointing` -- the API (``configure``, ``checkpoint``, ``get_cuda_rng_tracker``,
  ``model_parallel_cuda_manual_seed`` ...), served at ``dsplug.checkpointing`` and
  ``dsplug.runtime.activation_checkpointing.checkpointing`` (``dsplug_api_modules``);
* :mod:`.rng` -- ``CudaRNGStatesTracker``, named accelerator RNG states for model-parallel dropout;
* :mod:`.config` -- the section's schema (DeepSpeed's keys and defaults);
* :mod:`.observer` -- built for an engine whose config has the section: configures the API from
  it at ``dsplug_engine_built`` and reports the ``profile`` timings per step.

Entry point: ``observer-activation-checkpointing = "dsplug.plugins.activation_checkpointing"``.
Importing this module is cheap (no torch).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import ActivationCheckpointingConfig


def build_observer(section, context):
    """``factory(section, context)``: the engine's observer for its ``activation_checkpointing`` section."""
    from .observer import ActivationCheckpointingObserver

    return ActivationCheckpointingObserver(section, context)


SPEC = PluginSpec(
    category="observer",
    name="activation_checkpointing",
    section="activation_checkpointing",
    schema=ActivationCheckpointingConfig,
    factory=build_observer,
    summary="deepspeed.checkpointing: recompute activations in backward (partitioned, CPU, contiguous), "
            "configured from this section",
)


@hookimpl
def dsplug_observers():
    return [SPEC]


@hookimpl
def dsplug_api_modules():
    api = f"{__name__}.checkpointing"
    return [ApiModule("dsplug.checkpointing", api),
            ApiModule("dsplug.runtime.activation_checkpointing.checkpointing", api)]


@hookimpl
def dsplug_activation_checkpoint_function():
    """:func:`.checkpointing.checkpoint` (the pipeline's default ``activation_checkpoint_func``)."""
    from .checkpointing import checkpoint

    return checkpoint
