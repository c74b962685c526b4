"""DeepSpeed's ``deepspeed.runtime`` import paths, kept for scripts and integrations that use them.

* :mod:`.config` — ``DeepSpeedConfig`` (a config's derived values under DeepSpeed's attribute
  names) and DeepSpeed's config-key constants (:mod:`.constants`);
* :mod:`.lr_schedules` — the schedules and ``VALID_LR_SCHEDULES`` (from the scheduler plugins);
* :mod:`.zero` — ``zero.config`` (the ZeRO config model) and ``zero.partition_parameters``
  (``Init``, ``GatheredParameters``, ``ZeroParamStatus`` ...), from the ZeRO plugin;
* :mod:`.fp16` — ``fp16.loss_scaler`` (``LossScaler``, ``DynamicLossScaler``), from the
  precision plugin;
* :mod:`.activation_checkpointing` — ``activation_checkpointing.checkpointing`` (the
  ``dsplug.checkpointing`` API), from the activation checkpointing plugin;
* :mod:`.data_pipeline` — ``data_sampling`` (``DataAnalyzer``, ``DeepSpeedDataSampler``) and
  ``data_routing`` (random-LTD), from the data efficiency plugin;
* :mod:`.pipe` — ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``, ``ProcessTopology`` and the
  ``module`` / ``topology`` / ``engine`` / ``schedule`` submodules, from the pipeline plugin.

Submodules are imported on first attribute access, so ``dsplug.runtime.lr_schedules.VALID_LR_SCHEDULES``
works right after ``import dsplug`` as ``deepspeed.runtime...`` does after ``import deepspeed``.
"""
from __future__ import annotations

import importlib

_SUBMODULES = {"config", "constants", "engine", "lr_schedules", "zero", "fp16", "activation_checkpointing",
               "data_pipeline", "pipe"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
