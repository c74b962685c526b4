"""Registers ZeRO stage 3 as the ``zero_stage`` plugin named "3", and provides ``dsplug.zero``
(DeepSpeed's ``deepspeed.zero``: ``Init``, ``GatheredParameters``, ... in :mod:`.api`). Cheap to
import."""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl
from dsplug.descriptors import ApiModule

from .traits import TRAITS


def _build_stage3(module, param_groups, build_optimizer, precision, zero_config, context):
    from .stage import PartitionedParamStage

    return PartitionedParamStage(module, param_groups, build_optimizer, precision, zero_config, context)


@hookimpl
def dsplug_zero_stages():
    return [
        PluginSpec(category="zero_stage", name="3", factory=_build_stage3, traits=TRAITS,
                   summary="parameters, gradients and optimizer states partitioned; modules gather their "
                           "parameters just before use"),
    ]


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.zero", "dsplug.plugins.zero.stage3.api"),
            ApiModule("dsplug.runtime.zero", "dsplug.plugins.zero.stage3.api"),
            ApiModule("dsplug.runtime.zero.partition_parameters", "dsplug.plugins.zero.stage3.partition_parameters"),
            ApiModule("dsplug.utils.z3_leaf_module", "dsplug.plugins.zero.stage3.leaf")]


@hookimpl
def dsplug_gathered_parameters(params, modifier_rank):
    """``GatheredParameters`` for the parameters stage 3 holds partitioned (None if none is)."""
    from .partitioned_param import is_partitioned

    if not any(is_partitioned(p) for p in params):
        return None
    from .gathered import GatheredParameters

    return GatheredParameters(params, modifier_rank=modifier_rank)
