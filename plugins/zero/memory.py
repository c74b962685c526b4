"""Per-rank bytes of model states under each ZeRO stage (the ZeRO paper's accounting).

Ψ parameters, N data-parallel ranks, mixed precision with Adam (2 states):
  stage 0: 2Ψ + 2Ψ + 12Ψ = 16Ψ      stage 1: 2Ψ + 2Ψ + 12Ψ/N
  stage 2: 2Ψ + 14Ψ/N               stage 3: 16Ψ/N
In fp32 the parameters and gradients take 4 bytes each and there is no separate master copy.
With ``offload_optimizer`` the optimizer partition (and master weights) move to host memory; with
``offload_param`` (stage 3) the parameter partition does too.
"""
from __future__ import annotations

from typing import Any, Dict


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


#: fp32 values of optimizer state per parameter when the optimizer's spec does not say (Adam's 2)
DEFAULT_STATES_PER_PARAM = 2


def estimate_for_config(num_params: int, world_size: int, config) -> Dict[str, Any]:
    """The ``dsplug_estimate_model_state_bytes`` answer for a :class:`dsplug.DsplugConfig` whose
    stage is one of DeepSpeed's 0-3 (None for another stage: its plugin answers).

    Keys: ``"device"`` and ``"host"`` (as :func:`model_state_bytes`), ``"total"`` (both sides),
    ``"assumptions"`` (``stage``, ``mixed_precision``, ``optimizer_states_per_param``) and
    ``"summary"`` (the assumptions in words). 16-bit mixed precision is what the selected precision plugin
    builds: 16-bit parameters with fp32 master weights. The optimizer's states per parameter come
    from its spec's ``states_per_param``."""
    from dsplug.contracts.zero_stage import selected_traits

    zero = config.section("zero_optimization")
    traits = selected_traits(config) if zero is not None else None
    if zero is not None and (traits is None or traits.deepspeed_stage is None):
        return None  # a stage of its own kind answers for itself (or nothing is installed for it)
    stage = traits.zero_optimization_stage() if traits is not None else 0
    half = _half_precision(config, world_size)
    states = DEFAULT_STATES_PER_PARAM
    if config.optimizer is not None and config.optimizer.spec.states_per_param is not None:
        states = int(config.optimizer.spec.states_per_param)
    mem = model_state_bytes(
        int(num_params), int(world_size or 1), stage, half_precision=half, optimizer_states=states,
        offload_optimizer=zero is not None and zero.offload_optimizer.device != "none",
        offload_param=zero is not None and zero.offload_param.device != "none",
    )
    return {
        **mem,
        "total": mem["device"]["total"] + mem["host"]["total"],
        "assumptions": {"stage": stage, "mixed_precision": half, "optimizer_states_per_param": states},
        "summary": f"ZeRO stage {stage}, {'16-bit mixed precision' if half else 'fp32'}, "
                   f"{states} optimizer states per parameter",
    }


def _half_precision(config, world_size) -> bool:
    """Whether the precision this config selects keeps 16-bit parameters with fp32 master weights."""
    from dsplug.context import BuildContext

    provided, section = config.selection("precision")
    precision = provided.spec.factory(section, BuildContext(config=config, world_size=int(world_size or 1),
                                                            registry=config.registry))
    dtype = getattr(precision, "model_dtype", None)
    return bool(getattr(precision, "master_weights", False)) and getattr(dtype, "itemsize", 4) == 2
