"""``DeepSpeedCPUAdam``: Adam / AdamW on CPU parameters through the cpu_adam native op."""
from __future__ import annotations

import itertools

from dsplug.op_builder import CPUAdamBuilder

from ..cpu_optimizer import DeepSpeedCPUOptimizer, check_betas, check_hyper


class DeepSpeedCPUAdam(DeepSpeedCPUOptimizer):
    """DeepSpeed's CPU Adam. ``adamw_mode=True`` (default) decouples weight decay (AdamW,
    param *= 1 - lr * weight_decay); ``adamw_mode=False`` adds it to the gradient (Adam, L2).
    ``bias_correction`` divides the moments by (1 - beta^step). Results match
    torch.optim.AdamW / Adam in fp32. ``amsgrad`` is not supported (as in DeepSpeed).
    See :class:`~dsplug.ops.cpu_optimizer.DeepSpeedCPUOptimizer` for ``moment_dtype``,
    ``num_threads`` and ``step(fp16_param_groups=...)``.
    """

    BUILDER = CPUAdamBuilder
    STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _ids = itertools.count()

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True, *, moment_dtype=None, num_threads=None):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam does not support amsgrad=True (DeepSpeed's does not either); "
                             "use torch.optim.Adam(amsgrad=True) instead")
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        check_hyper("weight_decay", weight_decay)
        check_betas(betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=amsgrad)
        self.adamw_mode = bool(adamw_mode)
        self.adam_w_mode = self.adamw_mode  # DeepSpeed's spelling of the attribute
        self.opt_id = next(DeepSpeedCPUAdam._ids)
        super().__init__(model_params, defaults, fp32_optimizer_states=fp32_optimizer_states,
                         moment_dtype=moment_dtype, num_threads=num_threads)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("bias_correction", True)

    def _update(self, param, grad, state, group, out, threads) -> None:
        beta1, beta2 = group["betas"]
        self.op.adam_update(param, grad, state["exp_avg"], state["exp_avg_sq"], step=state["step"], lr=group["lr"],
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            bias_correction=group["bias_correction"], adamw_mode=self.adamw_mode, out=out,
                            num_threads=threads)


CPUAdam = DeepSpeedCPUAdam


def native_cpu_adam_fits(params, set_grad_none: bool = True) -> bool:
    """Whether these parameters (tensors or param groups) can step through the native cpu_adam op:
    all CPU-resident fp32, the op builds here, and ``DSPLUG_DISABLE_NATIVE_OPS`` is not set. The
    op always drops gradients after a step, so ``set_grad_none=False`` (keep them, zeroed) does
    not fit. The Adam optimizer plugins pick the op over their multi-tensor path on this test."""
    import torch

    from dsplug.op_builder import native_disabled, op_status

    if native_disabled() or set_grad_none is not True:
        return False
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if not tensors or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    return op_status("cpu_adam").compatible
