"""Registers the ZeRO stage ``fsdp2`` with its own ``zero_optimization`` keys (hooks only; cheap to
import: the stage imports torch's FSDP2 when it is built)."""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .config import STAGE_NAME, Fsdp2Config, fsdp2_rules
from .traits import TRAITS


def build_fsdp2_stage(module, param_groups, build_optimizer, precision, zero_config, context):
    from .stage import Fsdp2Stage

    return Fsdp2Stage(module, param_groups, build_optimizer, precision, zero_config, context)


@hookimpl
def dsplug_zero_stages():
    return [PluginSpec(category="zero_stage", name=STAGE_NAME, factory=build_fsdp2_stage, traits=TRAITS,
                       schema=Fsdp2Config, rules=(fsdp2_rules,),
                       summary="PyTorch FSDP2 (fully_shard): parameters, gradients and optimizer states sharded "
                               "by rows, gathered one unit at a time")]

