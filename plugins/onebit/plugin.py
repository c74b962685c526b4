"""The ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` optimizer plugins.

``optimizer.params`` takes DeepSpeed's arguments and defaults. The algorithms (exact formulas)
are in :mod:`.adam`, :mod:`.zoadam` and :mod:`.lamb`; what they share in :mod:`.common`;
the schemas in :mod:`.config`, factories and the stage-0 rule in :mod:`.factories`, per-rank checkpoint state in
:mod:`.checkpoint`. This module holds the hooks only.

* They run at ZeRO stage 0 only (a config error names the optimizer and the stage otherwise):
  they compress and scale whole tensors. Stage 0 asks ``communicates_gradients()`` before each
  step's backward and skips its gradient all-reduce when the optimizer averages itself.
* ``cuda_aware`` and ``comm_backend_name`` are accepted and have no effect: dsplug always
  communicates through its comm layer's process group (gloo on CPU, NCCL on CUDA), and moves
  tensors as that backend needs. ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and
  ignored, as DeepSpeed's 1-bit optimizers ignore them (use ``gradient_clipping``).
* Checkpoints at stage 0: the shared file holds rank 0's ``state_dict()``; :mod:`.checkpoint` adds
  each rank's own error-feedback buffers (and, in the middle of a 0/1 Adam local-step window,
  its own parameters and momentum) to that rank's file, so a resumed run continues exactly.

* DeepSpeed's import paths ``deepspeed.runtime.fp16.onebit[.adam|.zoadam|.lamb]`` (and the
  ``dsplug.runtime.fp16.onebit`` ones) give the classes, with DeepSpeed's names and constructor
  signatures, through the ``dsplug_api_modules`` hook below (:data:`API_PATHS`).

Nothing here imports torch at module level (plugin modules are imported at discovery).
"""
from __future__ import annotations

from dsplug.descriptors import PluginSpec
from dsplug.hookspecs import hookimpl

from .factories import onebit_adam_factory, onebit_lamb_factory, stage0_only, zero_one_adam_factory
from .config import OneBitAdamParams, OneBitLambParams, ZeroOneAdamParams

#: DeepSpeed's import paths of the three classes (``deepspeed.runtime.fp16.onebit.adam.OnebitAdam``, ...)
API_PATHS = {
    "dsplug.runtime.fp16.onebit": "dsplug.plugins.onebit.api",
    "dsplug.runtime.fp16.onebit.adam": "dsplug.plugins.onebit.adam",
    "dsplug.runtime.fp16.onebit.zoadam": "dsplug.plugins.onebit.zoadam",
    "dsplug.runtime.fp16.onebit.lamb": "dsplug.plugins.onebit.lamb",
}


@hookimpl
def dsplug_api_modules():
    from dsplug.descriptors import ApiModule

    return [ApiModule(path, target) for path, target in API_PATHS.items()]


@hookimpl
def dsplug_optimizers():
    return [
        PluginSpec(category="optimizer", name="OneBitAdam", factory=onebit_adam_factory, schema=OneBitAdamParams,
                   rules=[stage0_only("OneBitAdam")], ops=("cpu_adam",), states_per_param=3,
                   summary="1-bit Adam: AdamW warm-up, then frozen variance and 1-bit compressed momentum (stage 0)"),
        PluginSpec(category="optimizer", name="ZeroOneAdam", factory=zero_one_adam_factory, schema=ZeroOneAdamParams,
                   rules=[stage0_only("ZeroOneAdam")], ops=("cpu_adam",), states_per_param=5,
                   summary="0/1 Adam: sparse variance updates, 1-bit momentum, then 1-bit synchronised local steps "
                           "(stage 0)"),
        PluginSpec(category="optimizer", name="OneBitLamb", factory=onebit_lamb_factory, schema=OneBitLambParams,
                   rules=[stage0_only("OneBitLamb")], states_per_param=4,
                   summary="1-bit LAMB: LAMB warm-up, then frozen variance and trust ratio, 1-bit momentum "
                           "(stage 0)"),
    ]


@hookimpl
def dsplug_checkpoint_state(engine, scope, options):
    """Each rank's own error-feedback buffers (and, while 0/1 Adam's ranks diverge, its own
    parameters and local state) go into that rank's file."""
    from .checkpoint import rank_state

    return rank_state(engine, scope)


@hookimpl(trylast=True)
def dsplug_load_checkpoint_state(engine, checkpoint):
    """After the stage loaded rank 0's optimizer state: this rank's own part."""
    from .checkpoint import load_rank_state

    load_rank_state(engine, checkpoint)
