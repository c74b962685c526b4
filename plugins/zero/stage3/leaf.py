"""ZeRO-3 leaf modules (DeepSpeed's ``deepspeed.utils.z3_leaf_module``; the kernel's
``dsplug.utils.z3_leaf_module`` forwards here).

A leaf module is gathered as one unit: when its forward starts, the parameters of its whole
subtree are gathered together and held until its forward ends (and re-gathered together before its
backward), instead of each child gathering its own just before it runs. Use it for modules whose
children run in a data-dependent order or not at all (mixture-of-experts blocks), where gathering
child by child would break the recorded prefetch trace or leave ranks issuing different
all-gathers. Stage 3 reads the marks when the engine is built: mark before ``dsplug.initialize``.
"""
from __future__ import annotations

from typing import List, Sequence, Type, Union

import torch

LEAF_ATTR = "_z3_leaf"
PARAM_ATTR = "ds_z3_leaf_module"


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` is marked as a ZeRO-3 leaf module."""
    return bool(getattr(model, LEAF_ATTR, False))


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a marked leaf module."""
    return hasattr(param, PARAM_ATTR)


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The marked modules in ``model`` (itself included), in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches(module: torch.nn.Module, classes: Sequence[Union[Type, str]]) -> bool:
    for cls in classes:
        if isinstance(cls, str):
            if type(module).__name__ == cls or f"{type(module).__module__}.{type(module).__qualname__}" == cls:
                return True
        elif isinstance(module, cls) and type(module) is cls:
            return True
    return False


def _set(model: torch.nn.Module, classes, flag: bool, raise_if_not_found: bool) -> List[torch.nn.Module]:
    if isinstance(classes, (type, str)):
        classes = [classes]
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad[0]!r}")
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of class {', '.join(names)} found in {type(model).__name__}")
    for module in found:
        set_z3_leaf_module(module, flag)
    return found


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Mark (or unmark) one module."""
    object.__setattr__(model, LEAF_ATTR, bool(flag))
    for p in model.parameters():
        if flag:
            p.ds_z3_leaf_module = model
        elif getattr(p, PARAM_ATTR, None) is model:
            delattr(p, PARAM_ATTR)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                        ) -> List[torch.nn.Module]:
    """Mark every submodule of ``model`` whose class is one of ``leaf_module_classes`` (classes, or
    class names as strings); returns the marked modules. ValueError when none matches (unless
    ``raise_if_not_found=False``)."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                          ) -> List[torch.nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for those classes; returns the modules unmarked."""
    return _set(model, leaf_module_classes, False, raise_if_not_found)


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module", "z3_leaf_parameter"]
