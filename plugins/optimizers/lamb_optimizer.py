"""LAMB with DeepSpeed FusedLamb's arguments and semantics, on torch's multi-tensor ops (CPU too).

Importable as ``dsplug.ops.lamb.FusedLamb`` (the DeepSpeed import path).

One step, for every parameter tensor p with gradient g (t = steps taken, counting this one)::

    max_grad_norm > 0:   c = (‖all grads of the group‖ + 1e-6) / max_grad_norm;  g ← g / c if c > 1
    m ← β1·m + (1−β1)·g ;   v ← β2·v + (1−β2)·g²
    m̂ = m / (1−β1^t) ;      v̂ = v / (1−β2^t)           (no correction without bias_correction)
    u = m̂ / (√v̂ + ε)        (eps_inside_sqrt: m̂ / √(v̂ + ε))
    u ← u + wd·p
    r = ‖p‖ / ‖u‖ clipped to [min_coeff, max_coeff];   r = 1 when either norm is 0
    p ← p − lr · r · u

The trust ratio r is computed per parameter tensor, as FusedLamb does; :meth:`get_lamb_coeffs`
returns the last step's ratios. FusedLamb reads ``max_grad_norm`` against a norm its caller
passes in; here the group's gradient norm is computed, so the option works on its own.
"""
from __future__ import annotations

from typing import List

import torch

from dsplug.ops.multi_tensor import (
    adam_buckets,
    bias_corrections,
    check_hyperparameters,
    fill_group_defaults,
    trust_ratios,
    update_moments,
)

#: FusedLamb adds this to the gradient norm before comparing it with ``max_grad_norm``.
GRAD_NORM_EPS = 1e-6


class FusedLamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning").

    Arguments match DeepSpeed's ``FusedLamb``: ``lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0``
    (0 = no clipping), ``max_coeff=10.0, min_coeff=0.01, amsgrad=False`` (not supported).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant (amsgrad=True)")
        check_hyperparameters("FusedLamb", lr, betas, eps, weight_decay)
        if not max_grad_norm >= 0.0:
            raise ValueError(f"FusedLamb: invalid max_grad_norm={max_grad_norm!r}; must be >= 0 (0 = off)")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"FusedLamb: trust-ratio bounds must satisfy 0 <= min_coeff <= max_coeff; got "
                f"min_coeff={min_coeff!r}, max_coeff={max_coeff!r}"
            )
        defaults = dict(
            lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
            eps_inside_sqrt=bool(eps_inside_sqrt), weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: List[torch.Tensor] = []

    def get_lamb_coeffs(self) -> List[float]:
        """The trust ratios applied in the last step, one per updated parameter tensor."""
        return [float(c) for c in self.lamb_coeffs]

    def __setstate__(self, state):
        super().__setstate__(state)
        fill_group_defaults(self)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            buckets = adam_buckets(self, group, "FusedLamb")
            clip = _clip_factor(buckets, group["max_grad_norm"])
            for (_device, _dtype, taken), bucket in buckets.items():
                step = taken + 1
                bc1, bc2 = bias_corrections(step, beta1, beta2, group["bias_correction"])
                grads = bucket.grads
                if clip is not None:
                    grads = torch._foreach_div(grads, clip.to(bucket.params[0].device))
                update_moments(bucket, grads, beta1, beta2)

                update = torch._foreach_div(bucket.exp_avgs, bc1)  # m̂, becomes the update below
                denom = torch._foreach_div(bucket.exp_avg_sqs, bc2)  # v̂, becomes the denominator
                if group["eps_inside_sqrt"]:
                    torch._foreach_add_(denom, eps)
                    torch._foreach_sqrt_(denom)
                else:
                    torch._foreach_sqrt_(denom)
                    torch._foreach_add_(denom, eps)
                torch._foreach_div_(update, denom)
                if wd != 0:
                    torch._foreach_add_(update, bucket.params, alpha=wd)

                ratios = trust_ratios(bucket.params, update, group["min_coeff"], group["max_coeff"])
                torch._foreach_mul_(update, list(ratios.unbind(0)))
                torch._foreach_add_(bucket.params, update, alpha=-lr)
                self.lamb_coeffs.extend(ratios.unbind(0))
                bucket.advance(step)
        return loss


def _clip_factor(buckets, max_grad_norm: float):
    """The divisor for every gradient of the group (a 0-d tensor, >= 1), or None if clipping is off."""
    if not max_grad_norm > 0 or not buckets:
        return None
    device = next(iter(buckets.values())).params[0].device
    norms = [n.float().to(device) for b in buckets.values() for n in torch._foreach_norm(b.grads)]
    total = torch.linalg.vector_norm(torch.stack(norms))
    return torch.clamp((total + GRAD_NORM_EPS) / max_grad_norm, min=1.0)
