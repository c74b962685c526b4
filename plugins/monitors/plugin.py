"""Registers the built-in monitors (entry point ``monitors = "dsplug.plugins.monitors.plugin"``).

Hooks only: each monitor's spec is built by its feature module (``*_monitor.py``); the schemas of
the sections they own are in :mod:`.config`. DeepSpeed's ``deepspeed.monitor`` names are served
from :mod:`.deepspeed_monitor`.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule
from dsplug.hookspecs import hookimpl

from . import comet_monitor, csv_monitor, tensorboard_monitor, wandb_monitor


@hookimpl
def dsplug_monitors():
    return [*tensorboard_monitor.specs(), *csv_monitor.specs(), *wandb_monitor.specs(), *comet_monitor.specs()]


@hookimpl
def dsplug_api_modules():
    """DeepSpeed's ``deepspeed.monitor`` and its ``.config``, ``.tensorboard``, ``.wandb``,
    ``.csv_monitor`` and ``.comet`` submodules (:mod:`.deepspeed_monitor`)."""
    paths = ("dsplug.monitor", "dsplug.monitor.config", "dsplug.monitor.tensorboard", "dsplug.monitor.wandb",
             "dsplug.monitor.csv_monitor", "dsplug.monitor.comet")
    return [ApiModule(path, "dsplug.plugins.monitors.deepspeed_monitor") for path in paths]
