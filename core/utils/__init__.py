"""DeepSpeed's ``deepspeed.utils``: the names scripts and integrations import from it.

* :data:`logger`, :func:`log_dist` (:mod:`.logging`);
* :mod:`.groups` — process groups (``groups._get_data_parallel_world_size()`` ...), from the
  plugin declaring the path (the MoE plugin; the kernel's own are :mod:`dsplug.comm.groups`);
* ``safe_get_full_fp32_param`` / ``safe_get_full_grad`` / ``safe_get_full_optimizer_state`` /
  ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (:mod:`.tensor_fragment`):
  full values of a parameter whatever the ZeRO stage holds of it, answered by the engine's stage;
* ``set_z3_leaf_modules`` / ``unset_z3_leaf_modules`` / ``get_z3_leaf_modules`` /
  ``z3_leaf_module`` / ``z3_leaf_parameter`` (:mod:`.z3_leaf_module`, from the ZeRO stage-3 plugin);
* :mod:`.zero_to_fp32` — rebuild fp32 weights from a partitioned checkpoint (from the ZeRO plugin).

Everything is imported on first use.
"""
from __future__ import annotations

import importlib

_SUBMODULES = {"logging", "groups", "tensor_fragment", "z3_leaf_module", "zero_to_fp32"}

#: name -> submodule that defines it
_NAMES = {
    "logger": "logging",
    "log_dist": "logging",
    "print_json_dist": "logging",
    "get_current_level": "logging",
    "should_log_le": "logging",
    "safe_get_full_fp32_param": "tensor_fragment",
    "safe_get_full_grad": "tensor_fragment",
    "safe_get_full_optimizer_state": "tensor_fragment",
    "safe_set_full_fp32_param": "tensor_fragment",
    "safe_set_full_optimizer_state": "tensor_fragment",
    "set_z3_leaf_modules": "z3_leaf_module",
    "unset_z3_leaf_modules": "z3_leaf_module",
    "get_z3_leaf_modules": "z3_leaf_module",
    "z3_leaf_parameter": "z3_leaf_module",
}

__all__ = sorted(set(_NAMES) | {"groups", "zero_to_fp32", "z3_leaf_module"})

from . import z3_leaf_module as _leaf  # noqa: E402 - a forwarding module: importing it is cheap


def z3_leaf_module(model) -> bool:
    """Whether ``model`` is a ZeRO-3 leaf module (DeepSpeed's ``deepspeed.utils.z3_leaf_module``:
    the package attribute is this function, the submodule of the same name holds the others)."""
    return _leaf.z3_leaf_module(model)


def __getattr__(name):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES) | _SUBMODULES)
