"""Registers the precision plugin's DeepSpeed import path (entry point ``precision-api``):
``dsplug.runtime.fp16.loss_scaler`` -> :mod:`.ds_loss_scaler`. Cheap to import."""
from __future__ import annotations

from dsplug import hookimpl
from dsplug.descriptors import ApiModule


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.runtime.fp16.loss_scaler", "dsplug.plugins.precision.ds_loss_scaler")]
