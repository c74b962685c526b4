"""Registers the precision plugins: fp32 (default), fp16, bf16 and amp, each owning its config
section (schemas, rules and DeepSpeed config attributes in :mod:`.config`, factories in
:mod:`.factories`), and DeepSpeed's import path ``dsplug.runtime.fp16.loss_scaler``
(:mod:`.ds_loss_scaler`).

Entry point: ``precision = "dsplug.plugins.precision.plugin"``. Cheap to import (no torch).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import (AmpConfig, Bf16Config, Fp16Config, amp_deepspeed_config, bf16_deepspeed_config,
                     fp16_deepspeed_config, one_precision_mode)
from .factories import build_amp, build_bf16, build_fp16, build_fp32


@hookimpl
def dsplug_precisions():
    return [
        PluginSpec(category="precision", name="fp32", factory=build_fp32, default=True,
                   summary="full precision (default)"),
        PluginSpec(category="precision", name="fp16", section="fp16", schema=Fp16Config, factory=build_fp16,
                   rules=(one_precision_mode,), deepspeed_config=fp16_deepspeed_config,
                   summary="fp16 weights, fp32 master weights, loss scaling"),
        PluginSpec(category="precision", name="bf16", aliases=("bfloat16",), section="bf16", schema=Bf16Config,
                   factory=build_bf16, deepspeed_config=bf16_deepspeed_config,
                   summary="bf16 weights, fp32 master weights and gradient accumulation"),
        PluginSpec(category="precision", name="amp", section="amp", schema=AmpConfig, factory=build_amp,
                   deepspeed_config=amp_deepspeed_config, summary="torch.autocast around forward (Apex O1 semantics)"),
    ]


@hookimpl
def dsplug_api_modules():
    wrappers = "dsplug.plugins.precision.ds_wrapper_optimizers"
    return [ApiModule("dsplug.runtime.fp16.loss_scaler", "dsplug.plugins.precision.ds_loss_scaler"),
            ApiModule("dsplug.runtime.precision_config", "dsplug.plugins.precision.ds_precision_config"),
            ApiModule("dsplug.runtime.fp16.fused_optimizer", wrappers),
            ApiModule("dsplug.runtime.fp16.unfused_optimizer", wrappers),
            ApiModule("dsplug.runtime.bf16_optimizer", wrappers)]
