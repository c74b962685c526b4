"""Activation checkpointing: DeepSpeed's ``deepspeed.checkpointing`` API and the
``activation_checkpointing`` config section.

* :mod:`.checkpointing` -- the API (``configure``, ``checkpoint``, ``get_cuda_rng_tracker``,
  ``model_parallel_cuda_manual_seed`` ...), served at ``dsplug.checkpointing`` and
  ``dsplug.runtime.activation_checkpointing.checkpointing`` (``dsplug_api_modules``);
* :mod:`.rng` -- ``CudaRNGStatesTracker``, named accelerator RNG states for model-parallel dropout;
* :mod:`.config` -- the section's schema (DeepSpeed's keys and defaults);
* :mod:`.observer` -- built for an engine whose config has the section: configures the API from
  it at ``dsplug_engine_built`` and reports the ``profile`` timings per step.

:mod:`.plugin` (entry point ``observer-activation-checkpointing``) registers it; importing it is
cheap (no torch).
"""
