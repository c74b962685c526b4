"""The ``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` optimizer plugins.

``optimizer.params`` takes DeepSpeed's arguments and defaults. The algorithms (exact formulas)
are in :mod:`.adam`, :mod:`.zoadam` and :mod:`.lamb`; what they share in :mod:`.common`.

* They run at ZeRO stage 0 only (a config error names the optimizer and the stage otherwise):
  they compress and scale whole tensors. Stage 0 asks ``communicates_gradients()`` before each
  step's backward and skips its gradient all-reduce when the optimizer averages itself.
* ``cuda_aware`` and ``comm_backend_name`` are accepted and have no effect: dsplug always
  communicates through its comm layer's process group (gloo on CPU, NCCL on CUDA), and moves
  tensors as that backend needs. ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and
  ignored, as DeepSpeed's 1-bit optimizers ignore them (use ``gradient_clipping``).
* Checkpoints at stage 0: the shared file holds rank 0's ``state_dict()``; the hooks below add
  each rank's own error-feedback buffers (and, in the middle of a 0/1 Adam local-step window,
  its own parameters and momentum) to that rank's file, so a resumed run continues exactly.

* DeepSpeed's import paths ``deepspeed.runtime.fp16.onebit[.adam|.zoadam|.lamb]`` (and the
  ``dsplug.runtime.fp16.onebit`` ones) give the classes, with DeepSpeed's names and constructor
  signatures, through the ``dsplug_api_modules`` hook below (:data:`API_PATHS`).

Nothing here imports torch at module level (plugin modules are imported at discovery).
"""
from __future__ import annotations

from typing import Tuple

from dsplug import PluginSpec, hookimpl
from dsplug.config.params import (
    betas_check,
    cross_checks,
    given,
    options_of,
    partitions_optimizer_states,
    selected_optimizer_type,
    zero_stage,
)
from dsplug.config.schema import MAX_LR, field, schema

#: the checkpoint key of each rank's own 1-bit state (in that rank's file)
RANK_KEY = "onebit"

_BACKENDS = ("nccl", "mpi", "gloo", "hccl", "ccl", "compressed")
_BACKEND_INERT = ("dsplug always communicates through its comm layer's process group (gloo on CPU, NCCL on "
                  "CUDA); the compressed all-reduce is dsplug's own")
_CUDA_AWARE_INERT = "dsplug moves tensors as its comm backend needs; CUDA-aware MPI is not used"
_IGNORED = "DeepSpeed's 1-bit optimizers accept and ignore it; use gradient_clipping / eps"


def _no_amsgrad(value):
    return "the 1-bit optimizers do not support the AMSGrad variant; remove amsgrad" if value else None


def _ordered(low_key: str, high_key: str, low_default: float, high_default: float, meaning: str):
    def check(data):
        low, high = given(data, low_key, (int, float)), given(data, high_key, (int, float))
        low = low_default if low is None and low_key not in data else low
        high = high_default if high is None and high_key not in data else high
        if low is not None and high is not None and low > high:
            return (low_key, f"{low_key} ({low}) must not exceed {high_key} ({high}): they bound {meaning}")
        return None

    return check


@schema
class _OneBitCommon:
    """The keys every 1-bit optimizer takes."""

    lr: float = field(1e-3, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    betas: Tuple[float, float] = field((0.9, 0.999), auto=True, check=betas_check,
                                       doc="decay rates of the first and second moment averages")
    eps: float = field(1e-8, ge=0, auto=True, doc="added to the denominator sqrt(v) + eps")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="decoupled weight decay (p <- p * (1 - lr * wd))")
    bias_correction: bool = field(True, doc="divide the moments by (1 - beta^t) (DeepSpeed ignores it; dsplug "
                                            "applies it, so the warm-up equals AdamW / Lamb)")
    amsgrad: bool = field(False, check=_no_amsgrad, doc="not supported (must be false)")
    eps_inside_sqrt: bool = field(False, inert=_IGNORED, doc="accepted for DeepSpeed configs; no effect")
    max_grad_norm: float = field(0.0, ge=0, inert=_IGNORED, doc="accepted for DeepSpeed configs; no effect")
    cuda_aware: bool = field(False, inert=_CUDA_AWARE_INERT, doc="accepted for DeepSpeed configs; no effect")
    comm_backend_name: str = field("nccl", choices=_BACKENDS, case_insensitive=True, inert=_BACKEND_INERT,
                                   doc="accepted for DeepSpeed configs; dsplug uses its comm layer's backend")


@schema
class OneBitAdamParams(_OneBitCommon):
    """``optimizer.params`` for ``"type": "OneBitAdam"`` (DeepSpeed's OnebitAdam arguments)."""

    freeze_step: int = field(100000, ge=0, doc="warm-up steps of plain AdamW training before the variance "
                                                "freezes and the momentum is communicated in 1 bit")


@schema
class ZeroOneAdamParams(_OneBitCommon):
    """``optimizer.params`` for ``"type": "ZeroOneAdam"`` (DeepSpeed's ZeroOneAdam arguments)."""

    var_freeze_step: int = field(100000, ge=0, doc="the variance is updated (on an exponentially spaced schedule) "
                                                    "up to this step, then frozen and local steps begin")
    var_update_scaler: int = field(16, ge=1, doc="variance updates per interval: the interval between them "
                                                 "starts at 1 and doubles after every var_update_scaler updates")
    local_step_scaler: int = field(32678, ge=1, doc="after the variance freezes, the number of steps after which "
                                                    "the local-step interval doubles")
    local_step_clipper: int = field(16, ge=1, doc="the largest local-step interval (steps between synchronisations)")


@schema
class OneBitLambParams(_OneBitCommon):
    """``optimizer.params`` for ``"type": "OneBitLamb"`` (DeepSpeed's OnebitLamb arguments)."""

    weight_decay: float = field(0.0, ge=0, auto=True, doc="weight decay added to the update before the trust ratio")
    freeze_step: int = field(100000, ge=0, doc="warm-up steps of plain LAMB training before the variance and "
                                                "the trust ratio freeze and the momentum is communicated in 1 bit")
    max_coeff: float = field(10.0, ge=0, doc="upper bound of the warm-up trust ratio ||w|| / ||update||")
    min_coeff: float = field(0.01, ge=0, doc="lower bound of the warm-up trust ratio ||w|| / ||update||")
    coeff_beta: float = field(0.9, ge=0, lt=1, doc="decay of the running average of the trust ratio, frozen "
                                                   "after the warm-up")
    factor_max: float = field(4.0, ge=0, doc="largest factor applied to the frozen trust ratio")
    factor_min: float = field(0.5, ge=0, doc="smallest factor applied to the frozen trust ratio")
    factor_threshold: float = field(0.1, ge=0, doc="largest relative change of that factor from one step to the next")

    __rules__ = cross_checks(_ordered("min_coeff", "max_coeff", 0.01, 10.0, "the trust ratio"),
                             _ordered("factor_min", "factor_max", 0.5, 4.0, "the trust-ratio factor"))


def _kwargs(config, type_name: str, context, keep) -> dict:
    options = options_of(config, type_name)
    if options.get("amsgrad"):
        raise ValueError(f"optimizer.type = {type_name!r}: amsgrad is not supported (must be false)")
    kwargs = {k: v for k, v in options.items() if k in keep}
    if context is not None:
        kwargs.update(comm=context.comm, rank=int(context.rank), world_size=int(context.world_size))
    return kwargs


_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def onebit_adam_factory(params, config, context=None):
    from .adam import OnebitAdam

    return OnebitAdam(params, **_kwargs(config, "OneBitAdam", context, _ADAM_KEYS + ("freeze_step",)))


def zero_one_adam_factory(params, config, context=None):
    from .zoadam import ZeroOneAdam

    keep = _ADAM_KEYS + ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    return ZeroOneAdam(params, **_kwargs(config, "ZeroOneAdam", context, keep))


def onebit_lamb_factory(params, config, context=None):
    from .lamb import OnebitLamb

    keep = _ADAM_KEYS + ("freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                         "factor_threshold")
    return OnebitLamb(params, **_kwargs(config, "OneBitLamb", context, keep))


#: lower-case optimizer.type -> (name, why it needs whole parameters)
_WHOLE_TENSORS = {
    "onebitadam": ("OneBitAdam", "compresses whole momentum tensors"),
    "zerooneadam": ("ZeroOneAdam", "compresses whole momentum tensors and takes local steps on whole parameters"),
    "onebitlamb": ("OneBitLamb", "compresses whole momentum tensors and computes per-parameter trust ratios"),
}


def stage0_only(type_name: str):
    """A spec rule: ``type_name`` needs ZeRO stage 0 (``zero_allow_untested_optimizer`` does not
    change that). It acts only when ``optimizer.type`` selects ``type_name``."""
    key = type_name.lower()

    def rule(config, report) -> None:
        chosen = selected_optimizer_type(config)
        if chosen is None or chosen.strip().lower() != key:
            return
        stage = zero_stage(config)
        if partitions_optimizer_states(config):
            name, why = _WHOLE_TENSORS[key]
            report.error("optimizer.type", f"{name} {why}; use zero_optimization.stage 0 (it is {stage}: at stages "
                                           "1-3 each rank steps a flat slice of the parameters)")

    rule.__name__ = f"stage0_only[{type_name}]"
    return rule


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


# ----------------------------------------------------------------------------- per-rank checkpoint state
def _onebit_optimizer(engine):
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or not type(optimizer).__module__.startswith(__name__.rsplit(".", 1)[0]):
        return None
    from .common import OneBitOptimizer

    return optimizer if isinstance(optimizer, OneBitOptimizer) and optimizer.distributed else None


@hookimpl
def dsplug_checkpoint_state(engine, scope, options):
    """Each rank's own error-feedback buffers (and, while 0/1 Adam's ranks diverge, its own
    parameters and local state) go into that rank's file."""
    optimizer = _onebit_optimizer(engine) if scope == "rank" else None
    if optimizer is None:
        return None
    state = {"optimizer": optimizer.rank_state_dict()}
    if optimizer.ranks_diverge():
        state["params"] = [engine.stage.full_fp32_param(p) for p in engine.module.parameters()]
    return {RANK_KEY: state}


@hookimpl(trylast=True)
def dsplug_load_checkpoint_state(engine, checkpoint):
    """After the stage loaded rank 0's optimizer state: this rank's own part."""
    optimizer = _onebit_optimizer(engine)
    options = checkpoint.options
    if optimizer is None or options.load_module_only or not options.load_optimizer_states:
        return
    saved = checkpoint.rank.get(RANK_KEY)
    if not isinstance(saved, dict) or int(checkpoint.saved_world_size) != optimizer.world_size:
        optimizer.load_rank_state_dict(None)  # another world size: error feedback restarts from zero
        return
    optimizer.load_rank_state_dict(saved.get("optimizer"))
    params = saved.get("params")
    if params is not None:
        for p, value in zip(engine.module.parameters(), params):
            if value is not None:
                engine.stage.set_full_fp32_param(p, value)
