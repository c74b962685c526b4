"""The precision specs' factories: a :class:`~.policy.PrecisionPolicy` per mode (torch imported inside)."""
from __future__ import annotations

import math

from .config import AmpConfig, Bf16Config, Fp16Config


def _grad_accum_dtype(context, default):
    from .policy import dtype_from_name

    name = None
    if context is not None and context.config is not None:
        name = context.config.data_types.grad_accum_dtype
    return dtype_from_name(name) if name else default


def build_fp32(config, context):
    import torch

    from .policy import PrecisionPolicy

    return PrecisionPolicy("fp32", torch.float32, grad_accum_dtype=_grad_accum_dtype(context, torch.float32))


def build_fp16(config: Fp16Config, context):
    import torch

    from .loss_scaler import DynamicScaler, StaticScaler
    from .policy import PrecisionPolicy

    if config.loss_scale == 0:
        scaler = DynamicScaler(config.initial_scale_power, config.loss_scale_window, config.hysteresis,
                                   config.consecutive_hysteresis, config.min_loss_scale)
    else:
        scaler = StaticScaler(config.loss_scale)
    return PrecisionPolicy("fp16", torch.float16, master_weights=True,
                           grad_accum_dtype=_grad_accum_dtype(context, torch.float16), loss_scaler=scaler)


def _zero_stage(context) -> int:
    zero = context.config.sections.get("zero_optimization") if context is not None and context.config is not None \
        else None
    try:
        return int(getattr(zero, "stage", 0) or 0)
    except (TypeError, ValueError):  # "auto" not resolved (config check): the default stage
        return 0


def build_bf16(config: Bf16Config, context):
    import torch

    from .policy import PrecisionPolicy

    # Where micro-step gradients accumulate when data_types.grad_accum_dtype is not given, as in
    # DeepSpeed: under ZeRO (stages 1-3) in bf16, the model's dtype (its documented default; the sum
    # of the micro-steps' bf16 gradients is rounded to bf16 after each one, which shows in the
    # gradient norm: 4.004456 vs 4.005630 summed in fp32, tests/plugins/precision); without ZeRO in
    # fp32 (DeepSpeed's BF16_Optimizer keeps fp32 gradients).
    default = torch.bfloat16 if _zero_stage(context) >= 1 else torch.float32
    return PrecisionPolicy("bf16", torch.bfloat16, master_weights=True,
                           grad_accum_dtype=_grad_accum_dtype(context, default),
                           check_overflow=config.check_grad_overflow)


def build_amp(config: AmpConfig, context):
    import torch

    from .loss_scaler import DynamicScaler, StaticScaler
    from .policy import PrecisionPolicy, dtype_from_name

    device_type = context.accelerator.name if context is not None and context.accelerator is not None else "cpu"
    if config.opt_level == "O0":
        return PrecisionPolicy("amp", torch.float32, device_type=device_type)
    dtype = dtype_from_name(config.dtype or ("bf16" if device_type == "cpu" else "fp16"))
    scaler = None
    if dtype == torch.float16:
        if config.loss_scale == "dynamic":
            power = min(16, int(math.log2(config.max_loss_scale)))
            scaler = DynamicScaler(initial_scale_power=power, min_scale=config.min_loss_scale or 1.0,
                                       max_scale=config.max_loss_scale)
        else:
            scaler = StaticScaler(float(config.loss_scale))
    return PrecisionPolicy("amp", torch.float32, grad_accum_dtype=torch.float32, loss_scaler=scaler,
                           autocast_dtype=dtype, device_type=device_type)
