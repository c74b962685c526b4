"""Registers the built-in accelerators (entry point ``accelerators = "dsplug.plugins.accelerators.plugin"``).

Hooks only: :mod:`.cpu` and :mod:`.cuda` hold the accelerators and their specs (neither imports
torch at module level).
"""
from __future__ import annotations

from dsplug.hookspecs import hookimpl

from . import cpu, cuda


@hookimpl
def dsplug_accelerators():
    return [*cpu.specs(), *cuda.specs()]
