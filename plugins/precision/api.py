"""Registers the precision plugin's DeepSpeed import path (entry point ``precision-api``):
``dsplug.runtime.fp16.loss_scaler`` -> :mod:`.ds_loss_scaler`, ``dsplug.runtime.precision_config`` ->
:mod:`.ds_precision_config`, the wrapper-optimizer paths -> :mod:`.ds_wrapper_optimizers`. Cheap to import."""
from __future__ import annotations

from dsplug import hookimpl
from dsplug.descriptors import ApiModule


@hookimpl
def dsplug_api_modules():
    wrappers = "dsplug.plugins.precision.ds_wrapper_optimizers"
    return [ApiModule("dsplug.runtime.fp16.loss_scaler", "dsplug.plugins.precision.ds_loss_scaler"),
            ApiModule("dsplug.runtime.precision_config", "dsplug.plugins.precision.ds_precision_config"),
            ApiModule("dsplug.runtime.fp16.fused_optimizer", wrappers),
            ApiModule("dsplug.runtime.fp16.unfused_optimizer", wrappers),
            ApiModule("dsplug.runtime.bf16_optimizer", wrappers)]
