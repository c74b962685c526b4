"""Registers Mixture of Experts: DeepSpeed's ``deepspeed.moe`` / ``deepspeed.utils.groups`` import
paths, where expert gradients are averaged (``dsplug_reduction_groups``, ``dsplug_param_reduction``)
and the expert checkpoint files (:mod:`.checkpoint`).

Entry point: ``moe = "dsplug.plugins.moe.plugin"``. Nothing here imports torch.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule
from dsplug.hookspecs import hookimpl


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.moe", "dsplug.plugins.moe.api"),
            ApiModule("dsplug.moe.layer", "dsplug.plugins.moe.layer"),
            ApiModule("dsplug.moe.sharded_moe", "dsplug.plugins.moe.sharded_moe"),
            ApiModule("dsplug.moe.experts", "dsplug.plugins.moe.experts"),
            ApiModule("dsplug.moe.utils", "dsplug.plugins.moe.utils"),
            ApiModule("dsplug.utils.groups", "dsplug.plugins.moe.groups")]


# ------------------------------------------------------------------ where expert gradients are averaged
@hookimpl
def dsplug_reduction_groups(model):
    from .groups import create_expert_groups

    return create_expert_groups(model)


@hookimpl
def dsplug_param_reduction(param, context):
    if getattr(param, "allreduce", True):  # DeepSpeed's expert mark is allreduce=False
        return None
    from .groups import reduction_of

    return reduction_of(param, context)


# ------------------------------------------------------------------ checkpoints (module-level lifecycle hooks)
@hookimpl
def dsplug_checkpoint_state(engine, scope):
    from .checkpoint import checkpoint_state

    return checkpoint_state(engine, scope)


@hookimpl
def dsplug_checkpoint_files(engine, shared):
    from .checkpoint import checkpoint_files

    return checkpoint_files(engine, shared, engine.context.mp_rank)


@hookimpl
def dsplug_checkpoint_read(engine, checkpoint):
    from .checkpoint import checkpoint_read

    checkpoint_read(engine, checkpoint, engine.context.mp_rank, engine.config.checkpoint.weights_only)
