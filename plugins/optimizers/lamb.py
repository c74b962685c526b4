"""The ``Lamb`` optimizer plugin (DeepSpeed's FusedLamb semantics; runs on CPU too)."""
from __future__ import annotations

from typing import Tuple

from dsplug import PluginSpec
from dsplug.config.params import betas_check, cross_checks, given, options_of
from dsplug.config.schema import MAX_LR, field, schema


def _no_amsgrad(value):
    return "FusedLamb does not support the AMSGrad variant; remove amsgrad" if value else None


def _coeff_bounds_ordered(data):
    low, high = given(data, "min_coeff", (int, float)), given(data, "max_coeff", (int, float))
    low = 0.01 if low is None and "min_coeff" not in data else low
    high = 10.0 if high is None and "max_coeff" not in data else high
    if low is not None and high is not None and low > high:
        return ("min_coeff", f"min_coeff ({low}) must not exceed max_coeff ({high}): they bound the "
                "trust ratio ||w|| / ||update||")
    return None


@schema
class LambParams:
    """``optimizer.params`` for ``"type": "Lamb"`` (every FusedLamb constructor argument)."""

    lr: float = field(1e-3, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    bias_correction: bool = field(True, doc="divide the moments by (1 - beta^t)")
    betas: Tuple[float, float] = field((0.9, 0.999), auto=True, check=betas_check,
                                       doc="decay rates of the first and second moment averages")
    eps: float = field(1e-8, ge=0, auto=True, doc="added to the denominator sqrt(v) + eps")
    eps_inside_sqrt: bool = field(False, doc="use sqrt(v + eps) instead of sqrt(v) + eps")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="weight decay added to the update before the trust ratio")
    max_grad_norm: float = field(0.0, ge=0, doc="clip the group's gradient norm to this value (0 = off)")
    max_coeff: float = field(10.0, ge=0, doc="upper bound of the trust ratio ||w|| / ||update||")
    min_coeff: float = field(0.01, ge=0, doc="lower bound of the trust ratio ||w|| / ||update||")
    amsgrad: bool = field(False, check=_no_amsgrad, doc="not supported by FusedLamb (must be false)")

    __rules__ = cross_checks(_coeff_bounds_ordered)


def lamb_factory(params, config, context=None):
    from .lamb_optimizer import FusedLamb

    return FusedLamb(params, **options_of(config, "Lamb"))


def specs():
    """The Lamb optimizer spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="optimizer",
            name="Lamb",
            factory=lamb_factory,
            schema=LambParams,
            summary="LAMB (layer-wise trust ratio), DeepSpeed FusedLamb semantics",
        )
    ]
