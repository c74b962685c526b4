"""What a stage checks before it partitions: the optimizer (:func:`check_elementwise`) and the
model (:func:`refuse_partitioned_params`).

Which optimizers give the same result on a flat partition as on whole parameters.

ZeRO stages 1 and 2 hand the optimizer one flat tensor per param group: this rank's slice of all
the group's parameters laid end to end. An *element-wise* optimizer (each element's update
depends only on that element's weight, gradient and state, plus per-group scalars) computes
exactly what it would on the whole parameters. An optimizer that looks at a parameter as a whole
(LAMB's per-parameter trust ratio ``||w|| / ||update||``, Adafactor's factored row/column moments,
LARS, Shampoo, ...) would silently compute something else on a slice mixing several parameters,
so it is refused.

An optimizer class may declare itself with a class attribute ``dsplug_elementwise = True`` (or
False). Unknown classes are refused unless the top-level ``zero_allow_untested_optimizer`` is
true, as in DeepSpeed.
"""
from __future__ import annotations

from typing import Iterable

#: classes (by name anywhere in the MRO) known to compute per-parameter quantities
NOT_ELEMENTWISE = {
    "Lamb": "its trust ratio ||w|| / ||update|| is computed per parameter",
    "FusedLamb": "its trust ratio ||w|| / ||update|| is computed per parameter",
    "LAMB": "its trust ratio ||w|| / ||update|| is computed per parameter",
    "OnebitLamb": "its trust ratio ||w|| / ||update|| is computed per parameter",
    "Adafactor": "its second moment is factored into per-parameter row and column statistics",
    "LARS": "its trust ratio is computed per parameter",
    "Lars": "its trust ratio is computed per parameter",
    "LBFGS": "it keeps a history of whole-model directions and needs a closure",
    "SparseAdam": "it needs sparse gradients, not flat dense partitions",
    "Shampoo": "its preconditioners are per-parameter matrices",
    "Muon": "it orthogonalises each weight matrix as a whole",
}

#: torch.optim classes whose update is element-wise (per-group scalars aside)
TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop",
                     "Rprop", "ASGD")

#: dsplug's own and third-party element-wise optimizers, by qualified class name
KNOWN_ELEMENTWISE = {
    "dsplug.plugins.optimizers.adam_optimizer.FusedAdam",
    "dsplug.ops.adam.cpu_adam.DeepSpeedCPUAdam",
    "dsplug.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad",
    "dsplug.ops.lion.cpu_lion.DeepSpeedCPULion",
    "dsplug_lion.lion.Lion",
}


def _mro_names(cls) -> Iterable[str]:
    return [c.__name__ for c in cls.__mro__]


def _is_torch_elementwise(optimizer) -> bool:
    import torch

    return any(type(optimizer) is getattr(torch.optim, name, None) for name in TORCH_ELEMENTWISE)


def check_elementwise(optimizer, stage: int, allow_untested: bool) -> None:
    """Raise ValueError if ``optimizer`` would not give the same result on flat partitions."""
    cls = type(optimizer)
    declared = getattr(cls, "dsplug_elementwise", None)
    if declared is True:
        return
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    reason = next((NOT_ELEMENTWISE[n] for n in _mro_names(cls) if n in NOT_ELEMENTWISE), None)
    if declared is False and reason is None:
        reason = "the class declares dsplug_elementwise = False"
    if reason is not None:
        raise ValueError(
            f"ZeRO stage {stage} cannot use the optimizer {qualified}: {reason}, but at stage {stage} each rank "
            f"steps one flat slice of all a group's parameters, which would silently change the result. Use ZeRO "
            f"stage 0 with this optimizer, or an element-wise optimizer (Adam, AdamW, SGD, Adagrad, Lion, ...).")
    if _is_torch_elementwise(optimizer) or qualified in KNOWN_ELEMENTWISE:
        return
    if allow_untested:
        return
    raise ValueError(
        f"ZeRO stage {stage}: the optimizer {qualified} is not known to be element-wise. At stage {stage} each rank "
        f"steps one flat slice of all a group's parameters; that gives the same result only if every element's "
        f"update depends on that element alone. If it does, set \"zero_allow_untested_optimizer\": true at the top "
        f"level of the config (or give the class the attribute dsplug_elementwise = True); otherwise use stage 0.")


def refuse_partitioned_params(module, stage: int) -> None:
    """Stages 0-2 take whole parameters: a model built under ``dsplug.zero.Init`` needs stage 3."""
    if any(hasattr(p, "ds_id") for p in module.parameters()):  # partitioned (stage 3's ds_* attributes)
        raise ValueError(f"the model was built under dsplug.zero.Init, so its parameters are partitioned, but "
                         f"zero_optimization.stage is {stage}; use stage 3 (or build the model without zero.Init)")
