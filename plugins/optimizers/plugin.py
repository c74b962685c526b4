"""Registers the built-in optimizers (entry point ``optimizers = "dsplug.plugins.optimizers.plugin"``).

Hooks only: each optimizer's spec (schema, factory, rules) is built by its feature module, and
torch is imported in the factories, so discovery stays cheap.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule
from dsplug.hookspecs import hookimpl

from . import adagrad, adam, lamb, sgd, torch_optim


@hookimpl
def dsplug_optimizers():
    return [*adam.specs(), *lamb.specs(), *sgd.specs(), *adagrad.specs(), *torch_optim.torch_optimizer_specs()]


@hookimpl
def dsplug_api_modules():
    # DeepSpeed's ``deepspeed.ops.adam.FusedAdam`` / ``deepspeed.ops.lamb.FusedLamb`` are this plugin's
    # classes; the optimizer names of ``deepspeed.runtime.config`` (ADAM_OPTIMIZER ...) are this package's
    return [ApiModule("dsplug.ops.adam", "dsplug.plugins.optimizers.adam_optimizer"),
            ApiModule("dsplug.ops.lamb", "dsplug.plugins.optimizers.lamb_optimizer"),
            ApiModule("dsplug.runtime.config", "dsplug.plugins.optimizers.deepspeed_names")]
