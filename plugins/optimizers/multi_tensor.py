"""Gathering an optimizer's parameters into lists that ``torch._foreach_*`` ops can update at once.

Both :class:`~.adam_optimizer.FusedAdam` and :class:`~.lamb_optimizer.FusedLamb` keep Adam's
moment state (``step``, ``exp_avg``, ``exp_avg_sq`` — the same keys torch.optim.Adam uses, so a
state dict saved by one loads into the other). Parameters of a group are bucketed by device,
dtype and step count: one foreach call per bucket, bias corrections computed once per bucket.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import attrs
import torch


@attrs.define
class Bucket:
    params: List[torch.Tensor] = attrs.Factory(list)
    grads: List[torch.Tensor] = attrs.Factory(list)
    exp_avgs: List[torch.Tensor] = attrs.Factory(list)
    exp_avg_sqs: List[torch.Tensor] = attrs.Factory(list)
    states: List[dict] = attrs.Factory(list)

    def advance(self, step: int) -> None:
        """Record that every parameter of the bucket has now taken ``step`` steps."""
        for state in self.states:
            state["step"] = step


def fill_group_defaults(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: give loaded param groups the keys they lack from the constructor
    arguments (a state dict saved by torch.optim.AdamW has no ``bias_correction``, for example)."""
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)


def adam_buckets(optimizer: torch.optim.Optimizer, group: dict, owner: str) -> Dict[Tuple, Bucket]:
    """``(device, dtype, steps taken) -> Bucket`` for the parameters of ``group`` with a gradient.

    Moment state is created (zeros) on a parameter's first step. ``owner`` names the optimizer in
    error messages.
    """
    buckets: Dict[Tuple, Bucket] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{owner} does not support sparse gradients; use torch.optim.SparseAdam")
        if not p.is_floating_point():
            raise RuntimeError(
                f"{owner} updates real floating-point parameters; got a {p.dtype} parameter of shape "
                f"{tuple(p.shape)}. Use torch_adam: true (torch.optim handles complex parameters)."
            )
        state = optimizer.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grad = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
        # ``step`` may be a tensor when the state came from torch.optim.Adam(W).
        key = (p.device, p.dtype, int(state["step"]))
        bucket = buckets.setdefault(key, Bucket())
        bucket.params.append(p)
        bucket.grads.append(grad)
        bucket.exp_avgs.append(state["exp_avg"])
        bucket.exp_avg_sqs.append(state["exp_avg_sq"])
        bucket.states.append(state)
    return buckets


def update_moments(bucket: Bucket, grads: List[torch.Tensor], beta1: float, beta2: float) -> None:
    """m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²   (in place, all tensors of the bucket)."""
    torch._foreach_lerp_(bucket.exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(bucket.exp_avg_sqs, beta2)
    torch._foreach_addcmul_(bucket.exp_avg_sqs, grads, grads, value=1.0 - beta2)


def bias_corrections(step: int, beta1: float, beta2: float, enabled: bool) -> Tuple[float, float]:
    """(1 − β1^t, 1 − β2^t), or (1, 1) with bias correction off."""
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


def check_hyperparameters(owner: str, lr, betas, eps, weight_decay) -> None:
    """Constructor-time range checks shared by FusedAdam and FusedLamb."""
    if not lr >= 0.0:
        raise ValueError(f"{owner}: invalid learning rate lr={lr!r}; must be >= 0")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{owner}: invalid betas={tuple(betas)!r}; two coefficients in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"{owner}: invalid eps={eps!r}; must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"{owner}: invalid weight_decay={weight_decay!r}; must be >= 0")
