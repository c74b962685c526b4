"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed"): ``"optimizer": {"type": "OneBitAdam"}``.

t is the optimizer step (1-based, steps applied; overflow-skipped steps do not count), F =
``freeze_step``, W the data-parallel world size, g the gradient, p a (fp32 master) parameter;
corrections are 1 without ``bias_correction``.

**Warm-up, t ≤ F** — the ZeRO stage all-reduces the gradients (``communicates_gradients()`` is
False), and the step is exactly the ``AdamW`` optimizer type's (same kernel, bit-identical)::

    m ← β1·m + (1−β1)·g ;   v ← β2·v + (1−β2)·g²
    p ← p·(1 − lr·wd)
    p ← p − lr · (m / (1−β1^t)) / (√(v / (1−β2^t)) + ε)

**Compression, t > F** (W > 1: ``communicates_gradients()`` is True, g is this rank's LOCAL
gradient): v stays frozen at its value after step F (k = the number of v updates a parameter
had, F when it had a gradient at every warm-up step)::

    m ← β1·m + (1−β1)·g_local
    m ← CompressedAllReduce(m)           one flat buffer per param group, error feedback,
                                         per-tensor scaling (see dsplug.plugins.onebit.common)
    m ← 0 where v = 0                    (zero-variance mask)
    p ← p·(1 − lr·wd)
    p ← p − lr · (m / (1−β1^t)) / (√(v / (1−β2^k)) + ε)

Every rank gets the same m, so parameters stay identical on all ranks. With W = 1 nothing is
compressed: the step is Adam with the frozen variance.

Compared with DeepSpeed's ``OnebitAdam``: DeepSpeed ignores ``bias_correction`` (no corrections)
and compresses each tensor separately; weight decay there is ``update += wd·p`` then
``p -= lr·update``, the same decoupled decay. Parameters without a gradient take part in the
compression stage with g = 0.
"""
from __future__ import annotations

import torch

from dsplug.ops.multi_tensor import adam_buckets

from .common import OneBitOptimizer, check_deepspeed_arguments


class OnebitAdam(OneBitOptimizer):
    """1-bit Adam, with DeepSpeed's ``OnebitAdam`` signature and defaults (``deepspeed=None,
    lr=1e-3, freeze_step=100000, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    eps_inside_sqrt=False, weight_decay=0, max_grad_norm=0, amsgrad=False, cuda_aware=False,
    comm_backend_name='nccl'``; see :data:`.common.INERT_ARGUMENTS`) plus the keyword-only
    data-parallel ``comm`` / ``rank`` / ``world_size`` / ``group`` (see :class:`.common.OneBitOptimizer`)."""

    NAME = "OneBitAdam"

    def __init__(self, params, deepspeed=None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", *, comm=None, rank=None, world_size=None,
                 group=None):
        check_deepspeed_arguments(self.NAME, amsgrad, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm,
                                  cuda_aware=cuda_aware, comm_backend_name=comm_backend_name)
        if int(freeze_step) < 0:
            raise ValueError(f"{self.NAME}: freeze_step must be >= 0, got {freeze_step!r}")
        self.freeze_step = int(freeze_step)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, comm=comm, rank=rank, world_size=world_size, group=group,
                         deepspeed=deepspeed)

    def compressing(self, step: int) -> bool:
        return step > self.freeze_step

    def communicates_gradients(self) -> bool:
        return self.distributed and self.compressing(self.counters["step"] + 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.counters["step"] + 1
        for gi, group in enumerate(self.param_groups):
            if self.compressing(t):
                self._compressed_step(gi, group)
            else:
                for (_device, _dtype, taken), bucket in adam_buckets(self, group, self.NAME).items():
                    self.adamw_bucket(bucket, taken + 1, group)
                    bucket.advance(taken + 1)
        self.counters["step"] = t
        return loss

    def _compressed_step(self, gi: int, group: dict) -> None:
        params, grads, states = self.full_group(group)
        if not params:
            return
        beta1 = float(group["betas"][0])
        for st in states:
            st.setdefault("var_step", st["step"])  # v freezes now: the number of updates it had
        if self.distributed:
            scales = self.ensure_scaling(states)  # from the last synchronised momentum
        self.momentum_update(states, grads, beta1)
        if self.distributed:
            self.compressed_average_(gi, [st["exp_avg"] for st in states], scales)
        self.mask_zero_variance(states)
        for st in states:
            st["step"] += 1
        self.adam_apply(params, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                        self.corrections(group, [st["step"] for st in states], 0),
                        self.corrections(group, [st["var_step"] for st in states], 1), group)
