"""The ``SGD`` optimizer plugin: ``torch.optim.SGD`` with its documented arguments."""
from __future__ import annotations

from typing import Optional

from dsplug import PluginSpec
from dsplug.config.params import cross_checks, given, options_of
from dsplug.config.schema import MAX_LR, field, schema

from .common import call_torch_optimizer, untested_with_zero


def _nesterov_needs_momentum(data):
    if data.get("nesterov") is not True:
        return None
    momentum = given(data, "momentum", (int, float))
    dampening = given(data, "dampening", (int, float))
    if "momentum" not in data or (momentum is not None and momentum <= 0):
        return ("nesterov", "Nesterov momentum needs momentum > 0 (set optimizer.params.momentum)")
    if dampening is not None and dampening != 0:
        return ("nesterov", f"Nesterov momentum needs dampening = 0, got dampening = {dampening}")
    return None


@schema
class SGDParams:
    """``optimizer.params`` for ``"type": "SGD"`` (torch.optim.SGD's arguments and defaults)."""

    lr: float = field(1e-3, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    momentum: float = field(0.0, ge=0, doc="momentum factor")
    dampening: float = field(0.0, doc="dampening for momentum")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="L2 penalty added to the gradient")
    nesterov: bool = field(False, doc="Nesterov momentum (needs momentum > 0 and dampening 0)")
    maximize: bool = field(False, doc="maximize the objective instead of minimizing")
    foreach: Optional[bool] = field(None, doc="multi-tensor implementation (null: torch decides)")
    differentiable: bool = field(False, doc="let autograd run through the step")
    fused: Optional[bool] = field(None, doc="fused implementation (null: torch decides)")

    __rules__ = cross_checks(_nesterov_needs_momentum)


def sgd_factory(params, config, context=None):
    import torch

    return call_torch_optimizer(torch.optim.SGD, params, options_of(config, "SGD"), "SGD")


def specs():
    """The SGD optimizer spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="optimizer",
            name="SGD",
            factory=sgd_factory,
            schema=SGDParams,
            summary="stochastic gradient descent (torch.optim.SGD)",
            rules=[untested_with_zero(["SGD"], "torch.optim.SGD")],
        )
    ]
