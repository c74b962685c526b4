"""Registers the built-in monitors (entry point ``monitors = "dsplug.plugins.monitors.plugin"``).

Hooks only: each monitor's spec is built by its feature module (``*_monitor.py``); the schemas of
the sections they own are in :mod:`.config`.
"""
from __future__ import annotations

from dsplug.hookspecs import hookimpl

from . import comet_monitor, csv_monitor, tensorboard_monitor, wandb_monitor


@hookimpl
def dsplug_monitors():
    return [*tensorboard_monitor.specs(), *csv_monitor.specs(), *wandb_monitor.specs(), *comet_monitor.specs()]
