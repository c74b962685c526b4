"""``DeepSpeedCPUAdagrad``: Adagrad on CPU parameters through the cpu_adagrad native op."""
from __future__ import annotations

from dsplug.op_builder import CPUAdagradBuilder

from ..cpu_optimizer import DeepSpeedCPUOptimizer, check_hyper


class DeepSpeedCPUAdagrad(DeepSpeedCPUOptimizer):
    """DeepSpeed's CPU Adagrad; the update is torch.optim.Adagrad's (weight decay added to the
    gradient; ``lr_decay`` and ``initial_accumulator_value`` as in torch). The sum of squared
    gradients is stored as ``state['exp_avg_sq']`` like DeepSpeed; torch's ``'sum'`` is accepted
    by load_state_dict. ``amsgrad`` is not supported (as in DeepSpeed). A sparse gradient (e.g. of
    ``nn.Embedding(sparse=True)``) updates only the entries it holds, as torch's sparse Adagrad does
    (and, like it, without weight decay)."""

    BUILDER = CPUAdagradBuilder
    STATE_KEYS = ("exp_avg_sq",)
    STATE_ALIASES = {"sum": "exp_avg_sq"}
    SPARSE_GRADIENTS = True

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True,
                 *, lr_decay=0.0, initial_accumulator_value=0.0, moment_dtype=None, num_threads=None):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad does not support amsgrad=True (DeepSpeed's does not either)")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("lr_decay", lr_decay),
                            ("initial_accumulator_value", initial_accumulator_value)):
            check_hyper(name, value)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, lr_decay=lr_decay,
                        initial_accumulator_value=initial_accumulator_value)
        super().__init__(model_params, defaults, fp32_optimizer_states=fp32_optimizer_states,
                         moment_dtype=moment_dtype, num_threads=num_threads)

    def _init_state(self, param, group):
        state = super()._init_state(param, group)
        if group["initial_accumulator_value"]:
            state["exp_avg_sq"].fill_(group["initial_accumulator_value"])
        return state

    def _update(self, param, grad, state, group, out, threads) -> None:
        if grad.is_sparse:
            return self._sparse_update(param, grad, state, group, out, threads)
        self.op.adagrad_update(param, grad, state["exp_avg_sq"], step=state["step"], lr=group["lr"], eps=group["eps"],
                               weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], out=out,
                               num_threads=threads)

    def _sparse_update(self, param, grad, state, group, out, threads) -> None:
        """The dense update on the entries the gradient holds (its indices select rows of the
        sparse dimensions; each row's dense part is updated whole); the rest stays as it is."""
        if group["weight_decay"]:
            raise ValueError(f"weight_decay={group['weight_decay']} does not apply to a sparse gradient "
                             "(torch.optim.Adagrad refuses it too); set it to 0 for this parameter group")
        grad = grad.coalesce()
        rows = tuple(grad.indices())
        values, sums = param[rows], state["exp_avg_sq"][rows]  # copies of the touched entries
        self.op.adagrad_update(values, grad.values().contiguous(), sums, step=state["step"], lr=group["lr"],
                               eps=group["eps"], weight_decay=0.0, lr_decay=group["lr_decay"], out=None,
                               num_threads=threads)
        param[rows] = values
        state["exp_avg_sq"][rows] = sums
        if out is not None:
            out[rows] = values.to(out.dtype)

__all__ = ["DeepSpeedCPUAdagrad"]
