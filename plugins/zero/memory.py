"""Per-rank bytes of model states under each ZeRO stage (the ZeRO paper's accounting).

Ψ parameters, N data-parallel ranks, mixed precision with Adam (2 states):
  stage 0: 2Ψ + 2Ψ + 12Ψ = 16Ψ      stage 1: 2Ψ + 2Ψ + 12Ψ/N
  stage 2: 2Ψ + 14Ψ/N               stage 3: 16Ψ/N
In fp32 the parameters and gradients take 4 bytes each and there is no separate master copy.
With ``offload_optimizer`` the optimizer partition (and master weights) move to host memory; with
``offload_param`` (stage 3) the parameter partition does too.
"""
from __future__ import annotations

from typing import Dict


def model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    half_precision: bool = True,
    optimizer_states: int = 2,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> Dict[str, Dict[str, float]]:
    """``{"device": {...}, "host": {...}}`` with bytes of params, gradients and optimizer."""
    psi, n = float(num_params), float(world_size)
    weight = 2.0 if half_precision else 4.0
    master = 4.0 if half_precision else 0.0
    opt = master + 4.0 * optimizer_states
    params = psi * weight / (n if stage >= 3 else 1)
    grads = psi * weight / (n if stage >= 2 else 1)
    optim = psi * opt / (n if stage >= 1 else 1)
    device = {"parameters": params, "gradients": grads, "optimizer_states": optim}
    host = {"parameters": 0.0, "gradients": 0.0, "optimizer_states": 0.0}
    if offload_optimizer:
        host["optimizer_states"], device["optimizer_states"] = optim, 0.0
        # the fp32 gradient partition is copied to host for the CPU step
        host["gradients"] = psi * 4.0 / (n if stage >= 2 else 1) if half_precision else 0.0
    if offload_param and stage >= 3:
        host["parameters"], device["parameters"] = params, 0.0
    for side in (device, host):
        side["total"] = side["parameters"] + side["gradients"] + side["optimizer_states"]
    return {"device": device, "host": host}
