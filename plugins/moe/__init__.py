"""Mixture of Experts (DeepSpeed's ``deepspeed.moe``): ``MoE`` layers with top-1 / top-2 / top-k
gating, capacity and token dropping, the load-balancing loss, PR-MoE, and expert parallelism by
all-to-all over the ``"ep_size_<N>"`` groups of :mod:`.groups` (``dsplug.utils.groups``).

* :mod:`.sharded_moe` -- gating functions, ``TopKGate``, ``MOELayer`` (dispatch / all-to-all / combine)
* :mod:`.experts` -- ``Experts``: this rank's copies of the expert
* :mod:`.layer` -- ``MoE``: the layer a model uses (with PR-MoE's residual branch)
* :mod:`.utils` -- ``is_moe_param``, optimizer parameter groups for expert parameters
* :mod:`.checkpoint` -- expert weights saved one file per expert (DeepSpeed's layout), loadable
  at another ``ep_size``; registered through the checkpoint hooks of :mod:`.plugin`
* :mod:`.groups` -- DeepSpeed's ``deepspeed.utils.groups``: the kernel's data- / model-parallel
  names plus the expert-parallel and expert-data-parallel groups

How the engine and the ZeRO stages treat experts comes through the kernel's hooks (:mod:`.plugin`),
never through a stage knowing MoE: ``dsplug_reduction_groups`` creates the groups the model's
experts name, ``dsplug_param_reduction`` tells that an expert's gradient is averaged in its
expert-data-parallel group.

:mod:`.plugin` (entry point ``moe``) declares the import paths and the hooks.
"""
