"""DeepSpeed's ``deepspeed.utils``: the names scripts and integrations import from it.

* :data:`logger`, :func:`log_dist` (:mod:`.logging`);
* :mod:`.groups` — process groups (``groups._get_data_parallel_world_size()`` ...), from the
  plugin declaring the path (the MoE plugin; the kernel's own are :mod:`dsplug.comm.groups`);
* ``safe_get_full_fp32_param`` / ``safe_get_full_grad`` / ``safe_get_full_optimizer_state`` /
  ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` (:mod:`.tensor_fragment`):
  full values of a parameter whatever the ZeRO stage holds of it, answered by the engine's stage;
* ``set_z3_leaf_modules`` / ``unset_z3_leaf_modules`` / ``get_z3_leaf_modules`` /
  ``z3_leaf_module`` / ``z3_leaf_parameter`` (:mod:`.z3_leaf_module`, from the ZeRO stage-3 plugin);
* ``RepeatingLoader`` (:mod:`dsplug.dataloader`), :mod:`.torch` (``required_torch_version``),
  :mod:`.timer` (``trim_mean``);
* :mod:`.zero_to_fp32` — rebuild fp32 weights from a partitioned checkpoint (from the ZeRO plugin).

Everything is imported on first use (see :mod:`dsplug.api_paths`).
"""
from __future__ import annotations

import importlib
import sys
import types

from dsplug.api_paths import plugin_names

#: name -> submodule that defines it (``z3_leaf_module`` and ``zero_to_fp32`` are import paths the
#: ZeRO plugins declare; the rest are the kernel's)
_NAMES = {
    "logger": "logging",
    "log_dist": "logging",
    "print_json_dist": "logging",
    "get_current_level": "logging",
    "should_log_le": "logging",
    "RepeatingLoader": "dsplug.dataloader",
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


def z3_leaf_module(model) -> bool:
    """Whether ``model`` is a ZeRO-3 leaf module (DeepSpeed's ``deepspeed.utils.z3_leaf_module``:
    the package attribute is this function, the submodule of the same name holds the others)."""
    return importlib.import_module(f"{__name__}.z3_leaf_module").z3_leaf_module(model)


class _Package(types.ModuleType):
    """Importing the submodule ``z3_leaf_module`` binds it on this package (the import system does
    that for every child): the function of the same name stays the package attribute, as in
    DeepSpeed, whose package imports the submodule first and then the function over it."""

    def __setattr__(self, name, value):
        if name == "z3_leaf_module" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

_child, _children = plugin_names(__name__)


def __getattr__(name):
    if name in _NAMES:
        where = _NAMES[name]
        value = getattr(importlib.import_module(where if "." in where else f"{__name__}.{where}"), name)
        globals()[name] = value
        return value
    return _child(name)


def __dir__():
    return sorted(set(_children()) | set(_NAMES))
