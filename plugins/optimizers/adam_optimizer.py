"""Adam / AdamW with DeepSpeed FusedAdam's arguments and semantics.

Importable as ``dsplug.ops.adam.FusedAdam`` (the DeepSpeed import path). Works on every device
torch runs on (CPU included).

One step, for every parameter p with gradient g (t = steps taken, counting this one)::

    adam_w_mode = False (L2):          g ← g + wd·p
    m ← β1·m + (1−β1)·g
    v ← β2·v + (1−β2)·g²
    adam_w_mode = True (decoupled):    p ← p·(1 − lr·wd)
    p ← p − lr · (m / (1−β1^t)) / (√(v / (1−β2^t)) + ε)      (corrections are 1 without
                                                              bias_correction)

Two implementations of that step (the kernel's :mod:`dsplug.ops.multi_tensor`, shared with the
other Adam-family optimizers), chosen per bucket of same-device, same-dtype parameters:

* :func:`foreach_adam_step` — the formula above in ``torch._foreach_*`` ops (several passes over
  memory; one kernel launch per op on GPUs). Always available; the reference.
* torch's fused Adam kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``, one pass) where the
  installed torch has it for the device and dtype, and with bias correction on (the kernel always
  corrects). It computes the same formula; tests check the two paths agree. On CPU it is several
  times faster (see ``benchmarks/optimizers.py``). Set ``optimizer.use_fused_kernel = False`` to
  force the foreach path.
"""
from __future__ import annotations

from typing import Optional

import torch

from dsplug.ops.multi_tensor import (
    AdamHyper,
    adam_buckets,
    check_hyperparameters,
    fill_group_defaults,
    foreach_adam_step,
    fused_adam_step,
    fused_kernel_available,
)


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``: L2 penalty) or AdamW (``adam_w_mode=True``: decoupled decay).

    Arguments match DeepSpeed's ``FusedAdam``: ``lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False,
    set_grad_none=True``. AMSGrad is not supported (as in FusedAdam); use ``torch.optim.Adam``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        if amsgrad:
            raise RuntimeError(
                "FusedAdam does not support the AMSGrad variant (amsgrad=True); use torch.optim.Adam "
                "/ AdamW (optimizer.params.torch_adam: true in a config) for AMSGrad"
            )
        check_hyperparameters("FusedAdam", lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
            weight_decay=weight_decay, adam_w_mode=bool(adam_w_mode),
        )
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)
        self.adam_w_mode = bool(adam_w_mode)  # DeepSpeed's attribute: the constructor's mode (groups may differ)
        self.use_fused_kernel = True

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop gradients (``set_grad_none=True``, the default) or zero them in place."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def __setstate__(self, state):
        super().__setstate__(state)
        fill_group_defaults(self)
        self.__dict__.setdefault("use_fused_kernel", True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = AdamHyper.of(group)
            for (device, dtype, taken), bucket in adam_buckets(self, group, "FusedAdam").items():
                step = taken + 1
                if self.use_fused_kernel and hyper.bias_correction and fused_kernel_available(device, dtype):
                    fused_adam_step(bucket, step, hyper)
                else:
                    foreach_adam_step(bucket, step, hyper)
                bucket.advance(step)
        return loss
