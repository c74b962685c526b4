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

On CPU fp32 parameters the single pass is the kernel's native ``cpu_adam`` op (the one under
``DeepSpeedCPUAdam``, a little faster than torch's fused kernel: ``benchmarks/cpu_adam.py``) when it
is built here and not disabled (``DSPLUG_DISABLE_NATIVE_OPS``); so ``"type": "Adam"`` builds
FusedAdam on every device, as DeepSpeed does, without giving up that speed on CPU.
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
        self._native = None  # the cpu_adam op, resolved at the first CPU fp32 step

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Drop gradients (``set_grad_none=True``, the default) or zero them in place."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def __setstate__(self, state):
        super().__setstate__(state)
        fill_group_defaults(self)
        self.__dict__.setdefault("use_fused_kernel", True)
        self.__dict__.setdefault("_native", None)

    def _native_cpu_adam(self):
        """The native cpu_adam op, or False where it is not built or is disabled (asked once)."""
        if self._native is None:
            from dsplug.op_builder import CPUAdamBuilder, native_disabled, op_status

            usable = not native_disabled() and op_status("cpu_adam").compatible
            op = CPUAdamBuilder().load() if usable else None
            self._native = op if op is not None and op.native is not None else False
        return self._native

    def _step_bucket(self, bucket, device, dtype, step: int, hyper: AdamHyper) -> None:
        if self.use_fused_kernel and device.type == "cpu" and dtype == torch.float32 \
                and _native_step(self._native_cpu_adam(), bucket, step, hyper):
            return
        if self.use_fused_kernel and hyper.bias_correction and fused_kernel_available(device, dtype):
            fused_adam_step(bucket, step, hyper)
        else:
            foreach_adam_step(bucket, step, hyper)

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
                self._step_bucket(bucket, device, dtype, step, hyper)
                bucket.advance(step)
        return loss


def _native_step(op, bucket, step: int, h: AdamHyper) -> bool:
    """One Adam step of a CPU fp32 bucket through the native op, one pass per parameter; False
    (nothing done) without the op or where a tensor is not contiguous fp32."""
    tensors = (*bucket.params, *bucket.grads, *bucket.exp_avgs, *bucket.exp_avg_sqs)
    if not op or not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return False
    for p, g, m, v in zip(bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs):
        op.adam_update(p, g, m, v, step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                       weight_decay=h.weight_decay, bias_correction=h.bias_correction, adamw_mode=h.decoupled)
    return True
