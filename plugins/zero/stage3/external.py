"""External parameters: parameters a module's forward uses that belong to another module.

ZeRO stage 3 gathers a module's own parameters just before its forward. When a forward also
reads a parameter registered elsewhere (e.g. a language-model head reusing the embedding's
weight through ``F.linear(h, self.embed.weight)``), register it so that it is gathered with the
module's own, for the forward and for the backward::

    dsplug.zero.register_external_parameter(self, self.embed.weight)

(A parameter object registered as an attribute of both modules, the usual way to tie weights,
needs nothing: it is already a parameter of each.)
"""
from __future__ import annotations

from typing import List

import torch

_ATTR = "_ds_external_params"
#: bumped on every (un)registration so that cached fetch lists can notice
generation = 0


def _check(module, parameter) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_external_parameter: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError("register_external_parameter: parameter must be a torch.nn.Parameter, "
                        f"got {type(parameter).__name__}")


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather ``parameter`` together with ``module``'s own parameters (forward and backward)."""
    global generation
    _check(module, parameter)
    registered = module.__dict__.setdefault(_ATTR, {})
    if id(parameter) not in registered:
        registered[id(parameter)] = parameter
        generation += 1


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    global generation
    _check(module, parameter)
    registered = module.__dict__.get(_ATTR, {})
    if id(parameter) not in registered:
        raise ValueError(f"unregister_external_parameter: the parameter (shape {tuple(getattr(parameter, 'ds_shape', parameter.shape))}) is not "
                         f"registered as external to this {type(module).__name__}")
    del registered[id(parameter)]
    generation += 1


def external_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    return list(module.__dict__.get(_ATTR, {}).values())
