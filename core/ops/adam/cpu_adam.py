"""``DeepSpeedCPUAdam``: Adam / AdamW on CPU parameters through the cpu_adam native op."""
from __future__ import annotations

import itertools

import torch

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


    # ------------------------------------------------------------------ ZeRO-3 sub-groups
    def _subgroup_param(self, subgroup_id):
        """The one parameter with a gradient in the param groups now (a sub-group's flat partition)."""
        found = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                 if p.grad is not None]
        if len(found) != 1:
            raise ValueError(f"{type(self).__name__}: sub_group_id {subgroup_id}: the param groups must hold exactly "
                             f"one parameter with a gradient (the sub-group's flat partition); they hold {len(found)}")
        gi, pi, p = found[0]
        return p, self.param_groups[gi], f"param_groups[{gi}]['params'][{pi}]"

    @torch.no_grad()
    def step_subgroup(self, subgroup_id, closure=None):
        """DeepSpeed's ZeRO-3 offload entry: one Adam step of the parameter the param groups hold now
        (the sub-group's flat partition, swapped in), with its moments and step count kept in
        ``self.state[subgroup_id]`` instead of under the parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        param, group, where = self._subgroup_param(subgroup_id)
        self._check_param(param, where)
        state = self.state[subgroup_id] if self.state.get(subgroup_id) else self._init_state(param, group, subgroup_id)
        state["step"] += 1
        self._update(param, param.grad, state, group, None, self.num_threads or torch.get_num_threads())
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, subgroup_id, closure=None):
        """Undo the last :meth:`step_subgroup` of ``subgroup_id`` (e.g. after an overflow found
        late): the parameter and moments are recomputed backwards from the same gradient, which the
        parameter must still hold, and the step count goes down by one. Undoing the last step is
        exact up to fp32 rounding (a 16-bit parameter keeps the rounding of its update); undoing
        several recovers ``exp_avg_sq`` of near-zero gradients by cancellation, so the parameter
        comes back within about ``lr`` there."""
        state = self.state.get(subgroup_id)
        if not state or "exp_avg" not in state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {subgroup_id}: it has not "
                               "stepped (call step_subgroup first)")
        if state["step"] < 1:
            raise RuntimeError(f"Cannot rollback sub_group_id {subgroup_id}: step count is 0")
        param, group, _ = self._subgroup_param(subgroup_id)
        beta1, beta2 = group["betas"]
        lr, eps, decay, step = group["lr"], group["eps"], group["weight_decay"], state["step"]
        bc1 = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
        bc2 = 1.0 - beta2 ** step if group["bias_correction"] else 1.0
        m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
        p = param.detach().float()
        p = p + lr * (m / bc1) / (v.sqrt() / bc2 ** 0.5 + eps)
        if decay and self.adamw_mode:
            p = p / (1.0 - lr * decay)
        g = param.grad.float()
        if decay and not self.adamw_mode:
            g = g + decay * p
        state["exp_avg"].copy_((m - (1.0 - beta1) * g) / beta1)
        state["exp_avg_sq"].copy_(((v - (1.0 - beta2) * g * g) / beta2).clamp_(min=0.0))
        param.copy_(p)
        state["step"] = step - 1
        return None


CPUAdam = DeepSpeedCPUAdam


def native_cpu_adam_fits(params, set_grad_none: bool = True) -> bool:
    """Whether these parameters (tensors or param groups) can step through the native cpu_adam op:
    all CPU-resident fp32, the op builds here, and ``DSPLUG_DISABLE_NATIVE_OPS`` is not set. The
    op always drops gradients after a step, so ``set_grad_none=False`` (keep them, zeroed) does
    not fit. The 1-bit optimizers pick the op over their multi-tensor path on this test."""
    import torch

    from dsplug.op_builder import native_disabled, op_status

    if native_disabled() or set_grad_none is not True:
        return False
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if not tensors or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    return op_status("cpu_adam").compatible
