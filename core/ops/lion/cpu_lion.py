"""``DeepSpeedCPULion``: Lion on CPU parameters through the cpu_lion native op."""
from __future__ import annotations

from dsplug.op_builder import CPULionBuilder

from ..cpu_optimizer import DeepSpeedCPUOptimizer, check_betas, check_hyper


class DeepSpeedCPULion(DeepSpeedCPUOptimizer):
    """DeepSpeed's CPU Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms"):

        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p * (1 - lr * weight_decay) - lr * update
        m      = beta2 * m + (1 - beta2) * g
    """

    BUILDER = CPULionBuilder
    STATE_KEYS = ("exp_avg",)

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True, *,
                 moment_dtype=None, num_threads=None):
        check_hyper("lr", lr)
        check_hyper("weight_decay", weight_decay)
        check_betas(betas)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states=fp32_optimizer_states,
                         moment_dtype=moment_dtype, num_threads=num_threads)

    def _update(self, param, grad, state, group, out, threads) -> None:
        beta1, beta2 = group["betas"]
        self.op.lion_update(param, grad, state["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], out=out, num_threads=threads)
