"""Mixture of Experts (DeepSpeed's ``deepspeed.moe``): ``MoE`` layers with top-1 / top-2 / top-k
gating, capacity and token dropping, the load-balancing loss, PR-MoE, and expert parallelism by
all-to-all over the ``"ep_size_<N>"`` groups of :mod:`.groups` (``dsplug.utils.groups``).

* :mod:`.sharded_moe` -- gating functions, ``TopKGate``, ``MOELayer`` (dispatch / all-to-all / combine)
* :mod:`.experts` -- ``Experts``: this rank's copies of the expert
* :mod:`.layer` -- ``MoE``: the layer a model uses (with PR-MoE's residual branch)
* :mod:`.utils` -- ``is_moe_param``, optimizer parameter groups for expert parameters
* :mod:`.checkpoint` -- expert weights saved one file per expert (DeepSpeed's layout), loadable
  at another ``ep_size``; registered through the checkpoint hooks below
* :mod:`.groups` -- DeepSpeed's ``deepspeed.utils.groups``: the kernel's data- / model-parallel
  names plus the expert-parallel and expert-data-parallel groups

How the engine and the ZeRO stages treat experts comes through the kernel's hooks below, never
through a stage knowing MoE: ``dsplug_reduction_groups`` creates the groups the model's experts
name, ``dsplug_param_reduction`` tells that an expert's gradient is averaged in its
expert-data-parallel group.

This module is the entry point: it declares the import paths and the hooks; nothing here imports
torch.
"""
from dsplug import hookimpl
from dsplug.descriptors import ApiModule


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
