"""The precision sections' schemas (``fp16``, ``bf16``, ``amp``), the rule allowing one mode at a
time, and the ``DeepSpeedConfig`` attributes DeepSpeed derives from them."""
from __future__ import annotations

from typing import Optional, Union

from dsplug.config.schema import MAX_LOSS_SCALE, MIN_LOSS_SCALE, field, schema
from dsplug.contracts.zero_stage import selected_traits


def _static_loss_scale(value):
    """0 (dynamic scaling) or a static scale fp32 can hold, inverse included."""
    if value != 0 and not MIN_LOSS_SCALE <= value <= MAX_LOSS_SCALE:
        return "must be 0 (dynamic loss scaling) or a static scale between 2**-126 and 2**127 (fp32's range)"
    return None


@schema
class Fp16Config:
    enabled: bool = field(False, auto=True, doc="train with fp16 parameters and fp32 master weights")
    auto_cast: bool = field(False, doc="cast the inputs of forward to fp16", inert='forward inputs are not cast; pass fp16 inputs')
    loss_scale: float = field(0.0, ge=0, check=_static_loss_scale,
                              doc="0 = dynamic loss scaling; otherwise a static scale (2**-126 .. 2**127)")
    initial_scale_power: int = field(16, ge=0, le=127, doc="dynamic scaling starts at 2**this (<= 127: 2**128 "
                                     "is inf in fp32)")
    loss_scale_window: int = field(1000, ge=1, doc="overflow-free steps before the scale doubles")
    hysteresis: int = field(2, ge=1, doc="overflows tolerated before the scale halves")
    consecutive_hysteresis: bool = field(False, doc="refill hysteresis on every overflow-free step")
    min_loss_scale: float = field(1.0, ge=MIN_LOSS_SCALE, le=MAX_LOSS_SCALE,
                                  doc="the dynamic scale never goes below this (2**-126 .. 2**127: fp32's range, "
                                      "so that scaling and unscaling stay finite)")
    fp16_master_weights_and_grads: bool = field(False, doc="keep master weights in fp16 (ZeRO-Offload only)", inert='master weights and gradients are kept in fp32')


@schema
class Bf16Config:
    enabled: bool = field(False, auto=True, doc="train with bf16 parameters and fp32 master weights")
    immediate_grad_update: bool = field(False, doc="apply gradients as soon as they are reduced", inert='gradients are applied at the optimizer step')
    check_grad_overflow: bool = field(False, doc="skip steps whose gradients are not finite")


def amp_loss_scale_value(value):
    if isinstance(value, str) and value != "dynamic":
        return "must be 'dynamic' or a positive number"
    if not isinstance(value, str) and value <= 0:
        return "must be 'dynamic' or a positive number"
    if not isinstance(value, str) and not MIN_LOSS_SCALE <= value <= MAX_LOSS_SCALE:
        return "must be 'dynamic' or a static scale between 2**-126 and 2**127 (fp32's range)"
    return None


@schema
class AmpConfig:
    enabled: bool = field(False, auto=True, doc="torch.autocast mixed precision around forward")
    opt_level: str = field("O1", auto=True, choices=("O0", "O1", "O2", "O3"), case_insensitive=True,
                           doc="O1: autocast; O0: fp32 (O2/O3: use the fp16 section instead)")
    dtype: Optional[str] = field(None, choices=("fp16", "bf16"), doc="dsplug: autocast dtype (default: fp16 on "
                                 "accelerators with fp16 autocast, bf16 on CPU)")
    loss_scale: Union[str, float] = field("dynamic", check=amp_loss_scale_value,
                                          doc="'dynamic' or a static number (<= 2**127), for fp16 autocast")
    min_loss_scale: Optional[float] = field(None, ge=MIN_LOSS_SCALE, le=MAX_LOSS_SCALE,
                                            doc="lowest dynamic scale (2**-126 .. 2**127)")
    max_loss_scale: float = field(2.0 ** 24, ge=MIN_LOSS_SCALE, le=MAX_LOSS_SCALE,
                                  doc="highest dynamic scale (2**-126 .. 2**127)")
    keep_batchnorm_fp32: Optional[bool] = field(None, inert='an Apex option; dsplug amp is torch.autocast')
    master_weights: Optional[bool] = field(None, inert='an Apex option; dsplug amp is torch.autocast')
    cast_model_type: Optional[str] = field(None, inert='an Apex option; dsplug amp is torch.autocast')
    patch_torch_functions: Optional[bool] = field(None, inert='an Apex option; dsplug amp is torch.autocast')
    cast_model_outputs: Optional[str] = field(None, inert='an Apex option; dsplug amp is torch.autocast')
    num_losses: int = field(1, ge=1, inert='an Apex option; dsplug amp is torch.autocast')
    verbosity: int = field(1, ge=0, inert='an Apex option; dsplug amp is torch.autocast')


# ------------------------------------------------------------------------------------ rules
def one_precision_mode(config, report) -> None:
    enabled = [name for name in ("fp16", "bf16", "amp")
               if getattr(config.sections.get(name), "enabled", False) is True]
    if len(enabled) > 1:
        report.error(enabled[1], f"{' and '.join(enabled)} are both enabled; enable at most one precision mode "
                     "(fp16 xor bf16, and amp with neither)")
    amp = config.sections.get("amp")
    if amp is not None and amp.enabled is True:
        zero = config.sections.get("zero_optimization")
        traits = selected_traits(config) if zero is not None and zero.stage != "auto" else None
        if traits is not None and traits.partitions_anything:
            report.error("amp.enabled", f"amp cannot be combined with ZeRO (zero_optimization.stage is {zero.stage}); "
                         "use the fp16 or bf16 section with ZeRO")
        if amp.opt_level in ("O2", "O3"):
            report.error("amp.opt_level", f"{amp.opt_level!r} is not supported by dsplug's amp; use O1 (autocast), "
                         "or the fp16 section for O2-style fp16 weights with fp32 master weights")


# ----------------------------------------------------------------------------- DeepSpeedConfig attributes
def fp16_deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attributes of the ``fp16`` section."""
    fp16 = config.get("fp16") or {}
    enabled = fp16.get("enabled") is True
    loss_scale = fp16.get("loss_scale", 0) if enabled else 0
    power = fp16.get("initial_scale_power", 16)
    initial = 2 ** power if isinstance(power, int) else None
    return {
        "fp16_enabled": enabled,
        "fp16_auto_cast": bool(fp16.get("auto_cast", False)) if enabled else None,
        "fp16_master_weights_and_gradients": bool(fp16.get("fp16_master_weights_and_grads", False)),
        "loss_scale": loss_scale,
        "initial_dynamic_scale": initial,
        "dynamic_loss_scale_args": {
            "init_scale": initial,
            "scale_window": fp16.get("loss_scale_window", 1000),
            "delayed_shift": fp16.get("hysteresis", 2),
            "consecutive_hysteresis": fp16.get("consecutive_hysteresis", False),
            "min_scale": fp16.get("min_loss_scale", 1),
        } if enabled and not loss_scale else None,
    }


def bf16_deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attributes of the ``bf16`` section."""
    bf16 = config.get("bf16") or {}
    enabled = bf16.get("enabled") is True
    return {
        "bfloat16_enabled": enabled,
        "bf16_enabled": enabled,
        "bfloat16_immediate_grad_update": bool(bf16.get("immediate_grad_update", False)),
        "bfloat16_check_grad_overflow": bool(bf16.get("check_grad_overflow", False)),
    }


def amp_deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attributes of the ``amp`` section."""
    amp = config.get("amp") or {}
    enabled = amp.get("enabled") is True
    return {"amp_enabled": enabled, "amp_params": {k: v for k, v in amp.items() if k != "enabled"} if enabled else False}
