"""What every stage does to the fp32 gradients between reduction and the optimizer step."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch


def clip_coefficient(norm: float, clip: float) -> float:
    """``clip / (norm + 1e-6)``, computed in double (cast to the gradients' dtype when applied)."""
    return clip / (norm + 1e-6)


def fp32_clip_coefficient(norm: float, clip: float) -> float:
    """The same coefficient the way DeepSpeed's ZeRO stages 1 and 2 compute it: in fp32, as the
    reciprocal of ``(norm + 1e-6) / clip``. It can differ from :func:`clip_coefficient` in the
    last bit, which under bf16 is enough for a weight to round the other way a few steps later."""
    divisor = (torch.tensor(norm, dtype=torch.float32) + 1e-6) / clip
    return float(1.0 / divisor)


#: elements converted to fp64 at a time by :func:`fp64_square_sum` (512 KiB of fp64: stays in cache)
FP64_PIECE = 1 << 16


def fp64_square_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``grad``, accumulated in fp64 (a 0-dim fp64 tensor on its device).

    DeepSpeed's ZeRO stages take the gradient norm in fp64 by converting each gradient to fp64
    first. Converting a whole partition at once allocates 8 bytes per element every step, and on
    CPU faulting those fresh pages in costs more than the sum itself: 118 ms for a 25M-element
    partition on one thread, against 24 ms for this piecewise conversion through one small
    reused buffer. The pieces' fp64 sums differ from one whole-tensor sum only by fp64 rounding
    (7e-13 relative at 25M elements, measured), far below the fp32 rounding the norm gets next."""
    flat = grad.detach().reshape(-1)
    if flat.numel() <= FP64_PIECE:
        as64 = flat.double()
        return torch.dot(as64, as64)
    scratch = torch.empty(FP64_PIECE, dtype=torch.float64, device=flat.device)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), FP64_PIECE):
        piece = flat[start:start + FP64_PIECE]
        as64 = scratch[:piece.numel()].copy_(piece)
        total += torch.dot(as64, as64)
    return total


def unscale_check_clip(grads: List[torch.Tensor], precision, clip: float,
                       global_norm: Callable[[List[torch.Tensor]], float],
                       norm_always: bool = True,
                       coefficient: Callable[[float, float], float] = clip_coefficient,
                       deferred=None) -> Tuple[bool, Optional[float]]:
    """Unscale (``precision.unscale_``), take the global norm, detect overflow when
    ``precision.checks_overflow`` (and tell ``precision.update_scale``), clip to ``clip``. Returns
    ``(apply_step, norm)``; ``apply_step`` is False when an overflow means the step must be
    skipped. ``global_norm`` sees this rank's gradients and must return the norm over all ranks.
    With ``norm_always`` False the norm is only computed when clipping or the overflow check
    needs it (else None). ``coefficient(norm, clip)``: the factor the gradients are multiplied by
    when ``norm > clip``.

    ``deferred``: gradients not in ``grads`` (swapped out, e.g. stage 3's
    :class:`~dsplug.plugins.zero.stage3.offload_grads.SwappedGradients`): the unscaling and the
    clipping coefficient are folded into its ``scale(factor)`` (applied when it is read back), and
    ``global_norm`` must count them."""
    if grads:  # (all of them may be deferred)
        precision.unscale_(grads)
    if deferred is not None and precision.loss_scale != 1.0:
        deferred.scale(1.0 / precision.loss_scale)
    checks = precision.checks_overflow
    norm = global_norm(grads) if norm_always or clip > 0 or checks else None
    overflow = checks and not math.isfinite(norm)
    precision.update_scale(overflow)
    if overflow:
        return False, norm
    if norm is not None and clip > 0 and norm > clip:
        factor = coefficient(norm, clip)
        if grads:
            torch._foreach_mul_(grads, factor)
        if deferred is not None:
            deferred.scale(factor)
    return True, norm


def comm_dtype(kernel_config, accum_dtype):
    """The dtype gradients are reduced in: fp32 with ``fp32_allreduce``, the top-level
    ``communication_data_type`` when given, else the accumulation dtype."""
    if kernel_config.fp32_allreduce:
        return torch.float32
    name = kernel_config.communication_data_type
    if name:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    return accum_dtype
