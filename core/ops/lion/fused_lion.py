"""Lion with DeepSpeed FusedLion's arguments and semantics, on every device torch runs on.

Importable as ``dsplug.ops.lion.FusedLion`` (the DeepSpeed import path; ``DeepSpeedCPULion``, the
native CPU op, sits beside it). The config's ``"type": "Lion"`` is not built in: the third-party
example distribution ``contrib/dsplug-lion`` registers it. One step (Chen et al., "Symbolic Discovery of
Optimization Algorithms"), for every parameter p with gradient g and momentum m::

    p ← p · (1 − lr·wd)
    p ← p − lr · sign(β1·m + (1−β1)·g)
    m ← β2·m + (1−β2)·g

computed in fp32 for fp16 / bf16 parameters (written back in their dtype), with ``torch._foreach_*``
ops per bucket of same-device, same-dtype parameters.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

__all__ = ["FusedLion"]


class FusedLion(torch.optim.Optimizer):
    """Lion: ``lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True`` (FusedLion's
    arguments). Sparse gradients are refused."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True):
        if not lr >= 0.0:
            raise ValueError(f"FusedLion: invalid learning rate lr={lr!r}; must be >= 0")
        if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedLion: invalid betas={tuple(betas)!r}; two coefficients in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"FusedLion: invalid weight_decay={weight_decay!r}; must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            buckets = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedLion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                buckets[(p.device, p.dtype)].append(p)
            for (_device, dtype), params in buckets.items():
                _lion_bucket(params, [self.state[p]["exp_avg"] for p in params], lr, beta1, beta2, wd,
                             upcast=dtype in (torch.float16, torch.bfloat16))
        return loss


def _lion_bucket(params, moments, lr: float, beta1: float, beta2: float, wd: float, upcast: bool) -> None:
    grads = [p.grad for p in params]
    if upcast:
        work_p = [p.float() for p in params]
        work_m = [m.float() for m in moments]
        grads = [g.float() for g in grads]
    else:
        work_p, work_m = params, moments
    update = torch._foreach_mul(work_m, beta1)
    torch._foreach_add_(update, grads, alpha=1.0 - beta1)
    update = torch._foreach_sign(update)
    if wd != 0.0:
        torch._foreach_mul_(work_p, 1.0 - lr * wd)
    torch._foreach_add_(work_p, update, alpha=-lr)
    torch._foreach_mul_(work_m, beta2)
    torch._foreach_add_(work_m, grads, alpha=1.0 - beta2)
    if upcast:
        for p, w in zip(params, work_p):
            p.copy_(w)
        for m, w in zip(moments, work_m):
            m.copy_(w)
