"""ZeRO's ``zero_optimization`` section (entry point ``zero``; hooks only).

This module registers:

* the ``zero_optimization`` section, whose ``stage`` field selects the ``zero_stage`` plugin
  (``selects=("zero_stage", "stage")``: DeepSpeed's 0-3, registered by :mod:`.stage0.plugin`,
  :mod:`.stage12.plugin` and :mod:`.stage3.plugin`, or any name another plugin registers);
* the model-state memory estimate of ``dsplug config explain --params`` (:mod:`.memory`);
* the ``"auto"`` values derived from the model's hidden size (Hugging Face's convention);
* the partitioned checkpoint format's offline tools (:mod:`.checkpoint.zero_to_fp32`): the import paths
  ``dsplug.utils.zero_to_fp32`` / ``dsplug.zero_to_fp32`` and the ``dsplug zero-to-fp32`` command;
* DeepSpeed's config model names at ``dsplug.runtime.zero.config`` (:mod:`.ds_config`).
"""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl
from dsplug.descriptors import ApiModule

from .config import RULES, ZeroConfig
from .ds_config import deepspeed_config_attributes

#: ``"auto"`` keys derived from the model's hidden size h, as DeepSpeed's Hugging Face integration does
HIDDEN_SIZE_RULES = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


@hookimpl
def dsplug_config_sections():
    return [
        PluginSpec(
            category="section",
            name="zero_optimization",
            section="zero_optimization",
            schema=ZeroConfig,
            rules=RULES,
            selects=("zero_stage", "stage"),
            deepspeed_config=deepspeed_config_attributes,
            summary="ZeRO settings; zero_optimization.stage selects a zero_stage plugin",
        )
    ]


@hookimpl
def dsplug_estimate_model_state_bytes(num_params, world_size, config):
    """Per-rank bytes of model states under the configured stage (see :mod:`.memory`)."""
    from .memory import estimate_for_config

    return estimate_for_config(num_params, world_size, config)


@hookimpl
def dsplug_auto_value(path, hidden_size):
    rule = HIDDEN_SIZE_RULES.get(path)
    return rule(int(hidden_size)) if rule is not None else None


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.utils.zero_to_fp32", "dsplug.plugins.zero.checkpoint.zero_to_fp32"),
            ApiModule("dsplug.zero_to_fp32", "dsplug.plugins.zero.checkpoint.zero_to_fp32"),
            ApiModule("dsplug.runtime.zero.config", "dsplug.plugins.zero.ds_config"),
            # DeepSpeed's memory estimators, where its docs import them from
            ApiModule("dsplug.runtime.zero.stage3", "dsplug.plugins.zero.memory_estimators"),
            ApiModule("dsplug.runtime.zero.stage_1_and_2", "dsplug.plugins.zero.memory_estimators"),
            # DeepSpeed's ZeRO wrapper-optimizer classes: names that say dsplug has none (engine.stage instead)
            ApiModule("dsplug.runtime.zero.stage3", "dsplug.plugins.zero.ds_wrapper_optimizers"),
            ApiModule("dsplug.runtime.zero.stage_1_and_2", "dsplug.plugins.zero.ds_wrapper_optimizers"),
            ApiModule("dsplug.runtime.zero.utils", "dsplug.plugins.zero.errors")]


@hookimpl
def dsplug_cli_commands():
    from .cli import ZERO_TO_FP32

    return [ZERO_TO_FP32]
