"""dsplug entry point: registers the Lion optimizer and the schema of its params."""
from __future__ import annotations

from typing import Tuple

from dsplug import PluginSpec, hookimpl
from dsplug.config.schema import field, schema


def _betas_ok(value):
    if not all(0.0 <= b < 1.0 for b in value):
        return "each beta must be in [0, 1)"
    return None


@schema
class LionParams:
    lr: float = field(1e-4, gt=0, auto=True, doc="learning rate")
    betas: Tuple[float, float] = field((0.9, 0.99), auto=True, check=_betas_ok, doc="(β1, β2)")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="decoupled weight decay λ")


def build(params, config, context=None):
    from .lion import Lion

    return Lion(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


@hookimpl
def dsplug_optimizers():
    return [
        PluginSpec(
            category="optimizer",
            name="Lion",
            factory=build,
            schema=LionParams,
            summary="Lion (sign momentum) optimizer, third-party plugin",
            states_per_param=1,
        )
    ]
