"""1-bit LAMB (Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
Training with LAMB's Convergence Speed"): ``"optimizer": {"type": "OneBitLamb"}``.

t is the optimizer step (1-based; overflow-skipped steps do not count), F = ``freeze_step``,
W the data-parallel world size, corrections 1 without ``bias_correction``. Per parameter tensor
p the state adds to LAMB's m, v: ``lamb_coeff_freeze`` c̄ (0 at first), ``last_factor`` (1),
``exp_avg_sq_fresh`` v', ``scaling_coeff``, ``var_step`` k.

**Warm-up, t ≤ F** — gradients all-reduced by the ZeRO stage; exactly the ``Lamb`` optimizer
type (:class:`dsplug.ops.lamb.FusedLamb`, no gradient clipping, same
operations, bit-identical)::

    m ← β1·m + (1−β1)·g ;   v ← β2·v + (1−β2)·g²
    u = (m / (1−β1^t)) / (√(v / (1−β2^t)) + ε) + wd·p
    r = ‖p‖ / ‖u‖ clamped to [min_coeff, max_coeff];  r = 1 when either norm is 0
    p ← p − lr · r · u
    c̄ ← coeff_beta·c̄ + (1−coeff_beta)·r      (only when r ≠ 1, as DeepSpeed)

**Compression, t > F** (W > 1: ``communicates_gradients()`` True, g LOCAL). At the first
compression step of a parameter: v' ← v, k ← its number of v updates (F normally). Then::

    m₀ = m                                     (the synchronised momentum of the last step)
    m ← β1·m + (1−β1)·g_local ;  m ← CompressedAllReduce(m) ;  m ← 0 where v = 0
    ĝ = (m − β1·m₀) / (1−β1)                   (the averaged gradient, reconstructed)
    v' ← β2·v' + (1−β2)·ĝ²                      (fresh variance, never used in the update)
    d  = √(v / (1−β2^k)) + ε                   (frozen denominator)
    d' = √(v' / (1−β2^t)) + ε                  (fresh denominator)
    u₀ = (m / (1−β1^t)) / d ;   u = u₀ + wd·p
    f  = max over the tensor's elements of d / d'
    wd > 0:  ρ = min(1, ‖u₀‖ / ‖u‖) (1 when ‖u‖ = 0);  f ← f·ρ + (1 − ρ)
    f ← clamp(f, factor_min, factor_max)
    f ← clamp(f, last_factor·(1 − factor_threshold), last_factor·(1 + factor_threshold))
    last_factor ← f
    p ← p − lr · (c̄ · f) · u

So the trust ratio is frozen at its warm-up average c̄ and only rescaled by how much the variance
has moved since (f), within [factor_min, factor_max] and by at most ``factor_threshold``
(relative) per step. With W = 1 nothing is compressed.

Compared with DeepSpeed's ``OnebitLamb`` (the same algorithm): DeepSpeed applies no bias
correction, and computes the united momentum scale over all param groups (here: per group).
"""
from __future__ import annotations

from typing import List

import torch

from dsplug.ops.multi_tensor import adam_buckets, bias_corrections, trust_ratios, update_moments

from .common import OneBitOptimizer, check_deepspeed_arguments


class OnebitLamb(OneBitOptimizer):
    """1-bit LAMB, with DeepSpeed's ``OnebitLamb`` signature and defaults (``deepspeed=None,
    lr=1e-3, freeze_step=100000, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    eps_inside_sqrt=False, weight_decay=0, max_grad_norm=0, max_coeff=10.0, min_coeff=0.01,
    amsgrad=False, cuda_aware=False, comm_backend_name='nccl', coeff_beta=0.9, factor_max=4.0,
    factor_min=0.5, factor_threshold=0.1``; see :data:`.common.INERT_ARGUMENTS`) plus the
    keyword-only ``comm`` / ``rank`` / ``world_size`` / ``group`` (see :class:`.common.OneBitOptimizer`)."""

    NAME = "OneBitLamb"

    def __init__(self, params, deepspeed=None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, *, comm=None, rank=None, world_size=None,
                 group=None):
        check_deepspeed_arguments(self.NAME, amsgrad, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm,
                                  cuda_aware=cuda_aware, comm_backend_name=comm_backend_name)
        if int(freeze_step) < 0:
            raise ValueError(f"{self.NAME}: freeze_step must be >= 0, got {freeze_step!r}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"{self.NAME}: need 0 <= min_coeff <= max_coeff, got {min_coeff!r}, {max_coeff!r}")
        if not 0.0 <= factor_min <= factor_max:
            raise ValueError(f"{self.NAME}: need 0 <= factor_min <= factor_max, got {factor_min!r}, {factor_max!r}")
        if not 0.0 <= coeff_beta < 1.0 or not factor_threshold >= 0.0:
            raise ValueError(f"{self.NAME}: need 0 <= coeff_beta < 1 and factor_threshold >= 0")
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max, self.factor_min = float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, comm=comm, rank=rank, world_size=world_size, group=group,
                         deepspeed=deepspeed)
        self.lamb_coeffs: List[float] = []

    def compressing(self, step: int) -> bool:
        return step > self.freeze_step

    def communicates_gradients(self) -> bool:
        return self.distributed and self.compressing(self.counters["step"] + 1)

    def get_lamb_coeffs(self) -> List[float]:
        """The coefficients (trust ratio, or c̄·f) applied in the last step, one per parameter."""
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        t = self.counters["step"] + 1
        for gi, group in enumerate(self.param_groups):
            if self.compressing(t):
                self._compressed_step(gi, group)
            else:
                self._lamb_step(group)
        self.counters["step"] = t
        return loss

    def _lamb_step(self, group: dict) -> None:
        """FusedLamb.step's operations for one group (max_grad_norm 0, eps outside the sqrt)."""
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        for (_device, _dtype, taken), bucket in adam_buckets(self, group, self.NAME).items():
            step = taken + 1
            bc1, bc2 = bias_corrections(step, beta1, beta2, group["bias_correction"])
            update_moments(bucket, bucket.grads, beta1, beta2)
            update = torch._foreach_div(bucket.exp_avgs, bc1)
            denom = torch._foreach_div(bucket.exp_avg_sqs, bc2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            torch._foreach_div_(update, denom)
            if wd != 0:
                torch._foreach_add_(update, bucket.params, alpha=wd)
            ratios = trust_ratios(bucket.params, update, group["min_coeff"], group["max_coeff"])
            torch._foreach_mul_(update, list(ratios.unbind(0)))
            torch._foreach_add_(bucket.params, update, alpha=-lr)
            values = ratios.tolist()
            self.lamb_coeffs.extend(values)
            for st, r in zip(bucket.states, values):
                st.setdefault("lamb_coeff_freeze", 0.0)
                if r != 1.0:
                    st["lamb_coeff_freeze"] = self.coeff_beta * st["lamb_coeff_freeze"] + (1.0 - self.coeff_beta) * r
            bucket.advance(step)

    def _compressed_step(self, gi: int, group: dict) -> None:
        params, grads, states = self.full_group(group)
        if not params:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, wd, lr = float(group["eps"]), float(group["weight_decay"]), float(group["lr"])
        for st in states:
            if "exp_avg_sq_fresh" not in st:
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
                st["var_step"] = st["step"]
                st.setdefault("lamb_coeff_freeze", 0.0)
                st["last_factor"] = 1.0
        if self.distributed:
            scales = self.ensure_scaling(states)
        previous = [st["exp_avg"].clone() for st in states]
        self.momentum_update(states, grads, beta1)
        if self.distributed:
            self.compressed_average_(gi, [st["exp_avg"] for st in states], scales)
        self.mask_zero_variance(states)
        for st in states:
            st["step"] += 1
        bc1s = self.corrections(group, [st["step"] for st in states], 0)
        bc2_frozen = self.corrections(group, [st["var_step"] for st in states], 1)
        bc2_fresh = self.corrections(group, [st["step"] for st in states], 1)
        for p, st, m0, bc1, bcf, bc2 in zip(params, states, previous, bc1s, bc2_frozen, bc2_fresh):
            m, fresh = st["exp_avg"], st["exp_avg_sq_fresh"]
            g_hat = m.sub(m0, alpha=beta1).div_(1.0 - beta1)
            fresh.mul_(beta2).addcmul_(g_hat, g_hat, value=1.0 - beta2)
            denom = st["exp_avg_sq"].div(bcf).sqrt_().add_(eps)
            denom_fresh = fresh.div(bc2).sqrt_().add_(eps)
            update_prelim = m.div(bc1).div_(denom)
            update = update_prelim.add(p, alpha=wd) if wd > 0 else update_prelim
            factor = float((denom / denom_fresh).max()) if denom.numel() else 1.0
            if wd > 0:
                update_norm = float(torch.linalg.vector_norm(update))
                prelim_norm = float(torch.linalg.vector_norm(update_prelim))
                ratio = min(1.0, prelim_norm / update_norm) if update_norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = st["last_factor"]
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            st["last_factor"] = factor
            coeff = st["lamb_coeff_freeze"] * factor
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-lr * coeff)
