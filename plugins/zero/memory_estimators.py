"""DeepSpeed's ZeRO memory estimators, at DeepSpeed's import paths.

``deepspeed.runtime.zero.stage3``: ``estimate_zero3_model_states_mem_needs[_all_live | _all_cold]``,
``model_to_params``; ``deepspeed.runtime.zero.stage_1_and_2``:
``estimate_zero2_model_states_mem_needs[_all_live | _all_cold]`` (declared through the ZeRO
plugin's ``dsplug_api_modules``). They answer "how much CPU and GPU memory do the model states
(parameters, gradients, Adam states) need per node / per GPU" before a run, with DeepSpeed's
accounting, and print DeepSpeed's table (``_all_live`` from a model, ``_all_cold`` from counts).

Bytes, with Ψ parameters, L parameters in the largest layer, N GPUs in all, G GPUs per node, M
nodes, b the additional buffer factor (1.5 by default) and ⌊⌋ integer division:

ZeRO-3 (the GPU always holds the largest layer gathered in fp32, 4L):

================================  ========================  =======================================
offload                           per GPU                   per CPU (zero_init / not)
================================  ========================  =======================================
optimizer and parameters          4L                        18Ψ/M·b  /  max(4G, 18/M)·Ψ·b
optimizer only                    4L + ⌊2Ψ/N⌋               16Ψ/M·b  /  max(4G, 16/M)·Ψ·b
none                              4L + ⌊18Ψ/N⌋              4L·G·b   /  4Ψ·G·b
================================  ========================  =======================================

ZeRO-2: with optimizer offload 2Ψ per GPU and max(4N, 16)·Ψ·b per CPU; without, 2Ψ + ⌊18Ψ/N⌋ per
GPU and 4Ψ·G·b per CPU. The ZeRO-3 figures are those of DeepSpeed's documentation (its T0_3B
example: 2783M parameters, 65M in the largest layer); all of them were checked against DeepSpeed
0.19.8's functions over a grid of arguments (tests/data/deepspeed/memory_estimates.json).

The table prints the devices as DeepSpeed's documentation shows them (``offload_param=cpu ``);
DeepSpeed 0.19.8 itself, under Python 3.11, prints its enum there (``OffloadDeviceEnum.cpu``).
"""
from __future__ import annotations

from typing import Tuple

GB = 2 ** 30
_DEFAULT_BUFFER = 1.5


def model_to_params(model) -> Tuple[int, int]:
    """(parameters of ``model``, parameters of its largest layer): each parameter once, trainable
    or not; a layer is a module's own parameters (not its children's)."""
    total = sum(p.numel() for p in model.parameters())
    largest = max((sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()), default=0)
    return total, largest


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=_DEFAULT_BUFFER):
    """(CPU bytes per node, GPU bytes per GPU, bytes of the largest layer) for ZeRO-3."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        states = 18 if cpu_offload_params else 16  # bytes per parameter on the host
        gpu_mem = largest_layer_memory if cpu_offload_params else largest_layer_memory + int(2 * total_params / total_gpus)
        factor = states * per_node if zero_init else max(4 * num_gpus_per_node, states * per_node)
        cpu_mem = total_params * factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params  # what each process holds at load
        cpu_mem = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=_DEFAULT_BUFFER):
    """(CPU bytes per node, GPU bytes per GPU) for ZeRO-2."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def _header(num_gpus_per_node: int, num_nodes: int, model: str) -> str:
    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    gpus = f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''}"
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {nodes}, {gpus} per node.\n"
            f"SW: Model with {model}.\n"
            "  per CPU  |  per GPU |   Options")


def _row(cpu_mem: float, gpu_mem: float, options: str) -> str:
    return f" {cpu_mem / GB:7.2f}GB | {gpu_mem / GB:6.2f}GB | {options}"


def _millions(count) -> str:
    return f"{int(count / 1e6)}M"


def _device(offloaded: bool) -> str:
    return "cpu " if offloaded else "none"


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=_DEFAULT_BUFFER) -> None:
    """Print ZeRO-3's table for a model of ``total_params`` parameters whose largest layer has
    ``largest_layer_params`` (no model needed)."""
    lines = [_header(num_gpus_per_node, num_nodes, f"{_millions(total_params)} total params, "
                                                   f"{_millions(largest_layer_params)} largest layer params")]
    for offload, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload=offload,
                cpu_offload_params=offload_params, zero_init=zero_init, additional_buffer_factor=additional_buffer_factor)
            options = (f"offload_param={_device(offload_params)}, offload_optimizer={_device(offload)}, "
                       f"zero_init={int(zero_init)}")
            lines.append(_row(cpu_mem, gpu_mem, options))
    print("\n".join(lines))


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=_DEFAULT_BUFFER) -> None:
    """Print ZeRO-3's table for ``model`` (its parameters counted as :func:`model_to_params` does)."""
    total_params, largest_layer_params = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=_DEFAULT_BUFFER) -> None:
    """Print ZeRO-2's table for a model of ``total_params`` parameters (no model needed)."""
    lines = [_header(num_gpus_per_node, num_nodes, f"{_millions(total_params)} total params")]
    for offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
                                                                 cpu_offload=offload,
                                                                 additional_buffer_factor=additional_buffer_factor)
        lines.append(_row(cpu_mem, gpu_mem, f"offload_optimizer={_device(offload)}"))
    print("\n".join(lines))


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=_DEFAULT_BUFFER) -> None:
    """Print ZeRO-2's table for ``model``."""
    total_params, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)


__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
           "model_to_params"]
