"""The ``Adagrad`` optimizer plugin: ``torch.optim.Adagrad`` with its documented arguments."""
from __future__ import annotations

from typing import Optional

from dsplug import PluginSpec
from dsplug.config.params import options_of
from dsplug.config.schema import MAX_LR, field, schema

from .common import call_torch_optimizer, untested_with_zero


@schema
class AdagradParams:
    """``optimizer.params`` for ``"type": "Adagrad"`` (torch.optim.Adagrad's arguments and defaults)."""

    lr: float = field(1e-2, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    lr_decay: float = field(0.0, ge=0, doc="learning rate decay: lr / (1 + (t - 1) * lr_decay)")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="L2 penalty added to the gradient")
    initial_accumulator_value: float = field(0.0, ge=0, doc="starting value of the squared-gradient sum")
    eps: float = field(1e-10, ge=0, auto=True, doc="added to the denominator")
    foreach: Optional[bool] = field(None, doc="multi-tensor implementation (null: torch decides)")
    maximize: bool = field(False, doc="maximize the objective instead of minimizing")
    differentiable: bool = field(False, doc="let autograd run through the step")
    fused: Optional[bool] = field(None, doc="fused implementation (null: torch decides)")


def adagrad_factory(params, config, context=None):
    import torch

    return call_torch_optimizer(torch.optim.Adagrad, params, options_of(config, "Adagrad"), "Adagrad")


def specs():
    """The Adagrad optimizer spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="optimizer",
            name="Adagrad",
            factory=adagrad_factory,
            schema=AdagradParams,
            summary="Adagrad (torch.optim.Adagrad)",
            rules=[untested_with_zero(["Adagrad"], "torch.optim.Adagrad", tested_when_offloaded=True)],
        )
    ]
