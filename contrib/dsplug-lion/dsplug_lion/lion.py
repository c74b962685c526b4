"""Lion: sign of an interpolated momentum, decoupled weight decay.

    c  = β1·m + (1 − β1)·g
    p ← p·(1 − lr·λ) − lr·sign(c)
    m  = β2·m + (1 − β2)·g
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if lr <= 0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                if wd:
                    p.mul_(1 - lr * wd)
                update = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
