"""Adam-family optimizer steps on ``torch._foreach_*`` ops, shared by the optimizer plugins.

The ``Adam`` / ``AdamW`` and ``Lamb`` optimizers and the 1-bit optimizers (separate plugins) all
keep Adam's moment state (``step``, ``exp_avg``, ``exp_avg_sq`` -- the keys torch.optim.Adam uses,
so a state dict saved by one loads into another) and update it with the same operations; they
take them from here rather than from each other.

* :func:`adam_buckets` gathers a param group's parameters with a gradient into :class:`Bucket`\\ s
  of one device, dtype and step count: one foreach call per bucket, bias corrections computed
  once per bucket;
* :func:`update_moments`, :func:`bias_corrections`, :func:`trust_ratios` (LAMB) are the pieces
  of a step; :func:`check_hyperparameters` the constructor-time range checks;
* :func:`foreach_adam_step` / :func:`fused_adam_step` are one whole Adam step of a bucket (the
  formula in multi-tensor ops, or torch's single-pass fused kernel where
  :func:`fused_kernel_available`), bit-identical in what they compute up to the kernel's
  rounding (tests/test_optimizers.py).

One Adam step, for every parameter p with gradient g (t = steps taken, counting this one)::

    decoupled = False (L2):          g ← g + wd·p
    m ← β1·m + (1−β1)·g
    v ← β2·v + (1−β2)·g²
    decoupled = True (AdamW):        p ← p·(1 − lr·wd)
    p ← p − lr · (m / (1−β1^t)) / (√(v / (1−β2^t)) + ε)      (corrections are 1 without
                                                              bias_correction)
"""
from __future__ import annotations

import math
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


#: keys torch's ``Optimizer.__setstate__`` adds to ``defaults`` for its own optimizers' step
#: decorators; not hyperparameters of these optimizers, so not copied into their groups
_TORCH_BOOKKEEPING = frozenset({"differentiable"})


def fill_group_defaults(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: give loaded param groups the keys they lack from the constructor
    arguments (a state dict saved by torch.optim.AdamW has no ``bias_correction``, for example), so
    that a reloaded optimizer's groups hold the keys a fresh one's do."""
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            if key not in _TORCH_BOOKKEEPING:
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
    """Constructor-time range checks of the Adam-family optimizers."""
    if not lr >= 0.0:
        raise ValueError(f"{owner}: invalid learning rate lr={lr!r}; must be >= 0")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{owner}: invalid betas={tuple(betas)!r}; two coefficients in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"{owner}: invalid eps={eps!r}; must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"{owner}: invalid weight_decay={weight_decay!r}; must be >= 0")


def trust_ratios(params, updates, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """LAMB's ‖p‖ / ‖u‖ per tensor, clipped to [min_coeff, max_coeff]; 1 where either norm is 0."""
    w = torch.stack(torch._foreach_norm(params))
    u = torch.stack(torch._foreach_norm(updates))
    ratio = (w / u).clamp(min=min_coeff, max=max_coeff)
    return torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio))


# ----------------------------------------------------------------------------- one Adam step
class AdamHyper:
    """The hyper-parameters of one param group, as plain Python numbers."""

    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "bias_correction")

    @classmethod
    def of(cls, group: dict) -> "AdamHyper":
        hyper = cls()
        hyper.lr = float(group["lr"])
        hyper.beta1, hyper.beta2 = (float(b) for b in group["betas"])
        hyper.eps = float(group["eps"])
        hyper.weight_decay = float(group["weight_decay"])
        hyper.decoupled = bool(group["adam_w_mode"])
        hyper.bias_correction = bool(group["bias_correction"])
        return hyper


def foreach_adam_step(bucket: Bucket, step: int, h: AdamHyper) -> None:
    """The Adam step of the module docstring, written in multi-tensor ops."""
    bc1, bc2 = bias_corrections(step, h.beta1, h.beta2, h.bias_correction)
    grads = bucket.grads
    if h.weight_decay != 0 and not h.decoupled:
        grads = torch._foreach_add(grads, bucket.params, alpha=h.weight_decay)
    update_moments(bucket, grads, h.beta1, h.beta2)
    if h.weight_decay != 0 and h.decoupled:
        torch._foreach_mul_(bucket.params, 1.0 - h.lr * h.weight_decay)
    denom = torch._foreach_sqrt(bucket.exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(bucket.params, bucket.exp_avgs, denom, value=-h.lr / bc1)


def fused_adam_step(bucket: Bucket, step: int, h: AdamHyper) -> None:
    """The same step in torch's single-pass fused kernel (bias correction always on)."""
    kernel = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    step_count = torch.full((), float(step), dtype=torch.float32, device=bucket.params[0].device)
    kernel(
        bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs,
        [],  # no AMSGrad maxima
        [step_count] * len(bucket.params),  # read by the kernel for the bias corrections
        lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps,
        amsgrad=False, maximize=False,
    )


_FUSED_KERNEL_WORKS: Dict[Tuple[str, torch.dtype], bool] = {}


def fused_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused Adam kernels run for this device type and dtype (probed once)."""
    key = (device.type, dtype)
    if key not in _FUSED_KERNEL_WORKS:
        _FUSED_KERNEL_WORKS[key] = _probe_fused_kernel(device, dtype)
    return _FUSED_KERNEL_WORKS[key]


def _probe_fused_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    if not (hasattr(torch, "_fused_adam_") and hasattr(torch, "_fused_adamw_")):
        return False

    def one():
        return [torch.zeros(2, device=device, dtype=dtype)]

    try:
        for kernel in (torch._fused_adam_, torch._fused_adamw_):
            kernel(one(), one(), one(), one(), [], [torch.ones((), device=device)],
                   lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False
