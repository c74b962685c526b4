"""The ``Adam`` and ``AdamW`` optimizer plugins (DeepSpeed's FusedAdam semantics).

``optimizer.params`` takes FusedAdam's constructor arguments plus DeepSpeed's two switches:

* ``adam_w_mode`` (default true) — decoupled weight decay, p ← p·(1 − lr·wd) before the Adam
  update (AdamW); false: L2 regularisation, g ← g + wd·p before the moments. Type ``AdamW``
  always decouples.
* ``torch_adam`` (default false) — build ``torch.optim.AdamW`` (decoupled) or ``torch.optim.Adam``
  (L2) instead of dsplug's :class:`~.adam_optimizer.FusedAdam`.
"""
from __future__ import annotations

from typing import Tuple

from dsplug import PluginSpec
from dsplug.config.params import betas_check, cross_checks, given, options_of
from dsplug.config.schema import MAX_LR, field, schema

from .common import call_torch_optimizer


def _amsgrad_needs_torch_adam(data):
    if data.get("amsgrad") is True and data.get("torch_adam") is not True:
        return ("amsgrad", "FusedAdam does not support the AMSGrad variant: remove amsgrad, or set "
                "torch_adam: true to use torch.optim.Adam / AdamW, which implement it")
    return None


def _torch_adam_has_no_switch(key: str, fused_value, meaning: str):
    def check(data):
        if data.get("torch_adam") is True and given(data, key, bool) is not None and data[key] != fused_value:
            return (key, f"{key}: {str(data[key]).lower()} {meaning} is only available in dsplug's "
                    "FusedAdam; torch.optim.Adam / AdamW (torch_adam: true) have no such option")
        return None

    return check


_CHECKS = (
    _amsgrad_needs_torch_adam,
    _torch_adam_has_no_switch("bias_correction", True, "(no bias correction)"),
    _torch_adam_has_no_switch("set_grad_none", True, "(zero gradients in place)"),
)


@schema
class AdamParams:
    """``optimizer.params`` for ``"type": "Adam"``."""

    lr: float = field(1e-3, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    bias_correction: bool = field(True, doc="divide the moments by (1 - beta^t)")
    betas: Tuple[float, float] = field((0.9, 0.999), auto=True, check=betas_check,
                                       doc="decay rates of the first and second moment averages")
    eps: float = field(1e-8, ge=0, auto=True, doc="added to the denominator sqrt(v) + eps")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="weight decay (decoupled or L2, see adam_w_mode)")
    amsgrad: bool = field(False, doc="AMSGrad variant; only with torch_adam: true (FusedAdam refuses it)")
    adam_w_mode: bool = field(True, doc="true: decoupled weight decay (AdamW); false: L2 penalty added to the gradient")
    torch_adam: bool = field(False, doc="use torch.optim.AdamW / Adam instead of dsplug's FusedAdam")
    set_grad_none: bool = field(True, doc="FusedAdam's zero_grad() drops gradients (true) or zeroes them")

    __rules__ = cross_checks(*_CHECKS)


@schema
class AdamWParams(AdamParams):
    """``optimizer.params`` for ``"type": "AdamW"``: the same keys, ``adam_w_mode`` always true.

    ``adam_w_mode: false`` is accepted, as DeepSpeed accepts it, with a warning that it does not
    apply: AdamW always decouples weight decay (type Adam with ``adam_w_mode: false`` is L2)."""

    adam_w_mode: bool = field(True, inert="type AdamW always decouples weight decay, as in DeepSpeed; for an L2 "
                              "penalty use type Adam with adam_w_mode: false", doc="always true for AdamW")


def build_adam(params, options: dict, type_name: str, decoupled: bool):
    """FusedAdam, or torch.optim.AdamW / Adam with ``torch_adam``, from resolved options."""
    options = dict(options)
    torch_adam = options.pop("torch_adam", False)
    options.pop("adam_w_mode", None)
    if torch_adam:
        import torch

        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        for key in ("bias_correction", "set_grad_none"):
            if options.pop(key, True) is not True:
                raise ValueError(
                    f"optimizer.params.{key} = false is only available in dsplug's FusedAdam; "
                    f"torch_adam: true builds torch.optim.{cls.__name__}, which has no such option"
                )
        return call_torch_optimizer(cls, params, options, type_name)
    from .adam_optimizer import FusedAdam

    return FusedAdam(params, adam_w_mode=decoupled, **options)


def adam_factory(params, config, context=None):
    options = options_of(config, "Adam")
    return build_adam(params, options, "Adam", decoupled=options.get("adam_w_mode", True))


def adamw_factory(params, config, context=None):
    return build_adam(params, options_of(config, "AdamW"), "AdamW", decoupled=True)


def specs():
    """The Adam and AdamW optimizer specs (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="optimizer",
            name="Adam",
            factory=adam_factory,
            schema=AdamParams,
            ops=("cpu_adam",),
            summary="Adam, DeepSpeed FusedAdam semantics (adam_w_mode: decoupled decay by default; torch_adam)",
        ),
        PluginSpec(
            category="optimizer",
            name="AdamW",
            factory=adamw_factory,
            schema=AdamWParams,
            ops=("cpu_adam",),
            summary="AdamW (decoupled weight decay), DeepSpeed FusedAdam semantics (torch_adam)",
        ),
    ]
