"""ZeRO: the ``zero_optimization`` section and the stage plugins sharing one partitioning core."""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .config import RULES, ZeroConfig


def estimate_model_state_bytes(*args, **kwargs):
    """Per-rank bytes of model states (see :mod:`.memory`); used by ``dsplug config explain``."""
    from .memory import model_state_bytes

    return model_state_bytes(*args, **kwargs)


def build_stage0(module, param_groups, build_optimizer, precision, zero_config, context):
    from .stage0 import DataParallelStage

    return DataParallelStage(module, param_groups, build_optimizer, precision, zero_config, context.config.kernel,
                             context)


@hookimpl
def dsplug_zero_stages():
    return [
        PluginSpec(category="zero_stage", name="0", factory=build_stage0,
                   summary="plain data parallel: all-reduce of gradients overlapped with backward"),
    ]


@hookimpl
def dsplug_config_sections():
    return [
        PluginSpec(
            category="section",
            name="zero_optimization",
            section="zero_optimization",
            schema=ZeroConfig,
            rules=RULES,
            summary="ZeRO settings; zero_optimization.stage selects a zero_stage plugin",
            extra={"memory_estimator": estimate_model_state_bytes},
        )
    ]
