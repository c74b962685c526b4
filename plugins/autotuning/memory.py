"""Memory pruning: skip what cannot fit before launching it.

Per device, an experiment needs

    model states (the installed estimator: ``dsplug_estimate_model_state_bytes``, the same figure
                  ``dsplug config explain --params`` prints; for dsplug's ZeRO plugin the ZeRO
                  paper's 16Ψ / (4 + 12/N)Ψ ... accounting, device side only when offloading)
  + activations  (micro-batch size x the bytes autograd saved per sample in the model-info run)

and it is launched only when that is at most the budget: ``autotuning.device_memory`` when set
(bytes; a small fake budget is how to test pruning), else the accelerator's total memory (on
CPU: host memory divided by the processes per node, which share it).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

from .space import AutotuningError


def device_budget(configured: Optional[int], procs_per_node: int) -> Tuple[int, str]:
    """``(bytes per device, where the figure comes from)``."""
    if configured is not None:
        return int(configured), "autotuning.device_memory"
    from dsplug.accelerator import get_accelerator

    accelerator = get_accelerator()
    total = int(accelerator.total_memory())
    if total <= 0:
        raise AutotuningError("the accelerator reports no memory size; set autotuning.device_memory (bytes per device)")
    if accelerator.device_name() == "cpu":
        return total // max(1, procs_per_node), f"host memory / {procs_per_node} processes"
    return total, f"{accelerator.device_name()} memory"


def model_state_bytes(exp_config: Dict[str, Any], num_params: int, dp_world: int, registry=None) -> Dict[str, Any]:
    """The installed estimator's per-rank model states for ``exp_config`` (device side)."""
    from dsplug.config import DsplugConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DsplugConfig(exp_config, world_size=dp_world, registry=registry)
    estimate = config.registry.pm.hook.dsplug_estimate_model_state_bytes(
        num_params=int(num_params), world_size=int(dp_world), config=config)
    if estimate is None:
        raise AutotuningError("no installed plugin estimates model-state memory (the plugin owning the ZeRO stages "
                              "implements dsplug_estimate_model_state_bytes), so configs cannot be pruned; "
                              "`dsplug list` shows what is installed")
    device = estimate.get("device")
    total = float(device["total"]) if isinstance(device, dict) else float(estimate["total"])
    return {"bytes": total, "summary": estimate.get("summary", "")}


def fits(exp_config: Dict[str, Any], micro_batch: int, num_params: int, dp_world: int,
         activation_per_sample: float, budget: int, registry=None) -> Dict[str, Any]:
    """``{"fits", "model_states", "activations", "total", "budget", "summary"}`` for one experiment."""
    states = model_state_bytes(exp_config, num_params, dp_world, registry)
    activations = float(activation_per_sample) * int(micro_batch)
    total = states["bytes"] + activations
    return {"fits": total <= budget, "model_states": states["bytes"], "activations": activations, "total": total,
            "budget": budget, "summary": states["summary"]}


def largest_micro_batch(states_bytes: float, activation_per_sample: float, budget: int, cap: int) -> int:
    """The largest micro-batch size whose activations fit beside the model states (at most ``cap``; 0: none)."""
    room = budget - states_bytes
    if room < 0:
        return 0
    if activation_per_sample <= 0:
        return cap
    return int(min(cap, room // activation_per_sample))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n} B"
