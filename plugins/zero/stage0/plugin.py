"""Registers ZeRO stage 0 as the ``zero_stage`` plugin named "0" (hooks only; cheap to import)."""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .traits import TRAITS


def _build_stage0(module, param_groups, build_optimizer, precision, zero_config, context):
    from ..partitioning.checks import refuse_partitioned_params
    from .stage import DataParallelStage

    refuse_partitioned_params(module, 0)
    return DataParallelStage(module, param_groups, build_optimizer, precision, zero_config, context.config.kernel,
                             context)


@hookimpl
def dsplug_zero_stages():
    return [
        PluginSpec(category="zero_stage", name="0", factory=_build_stage0, traits=TRAITS,
                   summary="plain data parallel: all-reduce of gradients overlapped with backward"),
    ]
