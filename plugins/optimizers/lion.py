"""The ``Lion`` optimizer plugin (DeepSpeed's FusedLion / DeepSpeedCPULion semantics).

``optimizer.params``: ``lr``, ``betas``, ``weight_decay``. CPU-resident fp32 parameters (ZeRO-Offload's
host master weights, or a CPU run) step through the kernel's native ``DeepSpeedCPULion`` where its
op builds; everything else through :class:`.lion_optimizer.FusedLion` (torch foreach ops), the
same formula.
"""
from __future__ import annotations

from typing import Tuple

from dsplug import PluginSpec, hookimpl
from dsplug.config.params import betas_check, options_of
from dsplug.config.schema import MAX_LR, field, schema
from dsplug.descriptors import ApiModule


@schema
class LionParams:
    """``optimizer.params`` for ``"type": "Lion"``."""

    lr: float = field(1e-3, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    betas: Tuple[float, float] = field((0.9, 0.999), auto=True, check=betas_check,
                                       doc="beta1 mixes momentum and gradient for the update's sign; beta2 "
                                           "decays the momentum")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="decoupled weight decay p <- p * (1 - lr * wd)")


def _cpu_fp32(params) -> bool:
    import torch

    from dsplug.op_builder import native_disabled, op_status

    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return (bool(tensors) and not native_disabled() and op_status("cpu_lion").compatible
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors))


def lion_factory(params, config, context=None):
    options = options_of(config, "Lion")
    params = list(params)
    if _cpu_fp32(params):
        from dsplug.ops.lion import DeepSpeedCPULion

        return DeepSpeedCPULion(params, **options)
    from .lion_optimizer import FusedLion

    return FusedLion(params, **options)


@hookimpl
def dsplug_optimizers():
    return [PluginSpec(category="optimizer", name="Lion", factory=lion_factory, schema=LionParams,
                       ops=("cpu_lion",), summary="Lion (sign of interpolated momentum), DeepSpeed FusedLion semantics")]


@hookimpl
def dsplug_api_modules():
    # DeepSpeed's ``deepspeed.ops.lion.FusedLion`` is this plugin's optimizer class
    return [ApiModule("dsplug.ops.lion", "dsplug.plugins.optimizers.lion_optimizer")]
