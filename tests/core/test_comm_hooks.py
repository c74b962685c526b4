"""The comm layer reports every collective through the ``dsplug_comm_op`` hook, on
``dsplug.comm.events``: nothing is timed or synchronized while no implementation is registered,
``caller`` is looked up only for implementations that take it, module-level implementations of
installed plugins are registered with the process-wide registry, and ``log_summary`` asks
``dsplug_comm_summary``."""
from __future__ import annotations

import contextlib
import io
import sys
import types

import torch

import dsplug.comm as comm
from dsplug import hookimpl
from dsplug.testing import make_registry
from tests.dist_harness import run_distributed


class Ops:
    def __init__(self):
        self.seen = []

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, world_size, async_op):
        self.seen.append((op, nbytes, world_size, async_op))


class Callers:
    def __init__(self):
        self.seen = []

    @hookimpl
    def dsplug_comm_op(self, op, caller):
        self.seen.append((op, caller))


class Summary:
    @hookimpl
    def dsplug_comm_summary(self, show_straggler):
        print(f"summary straggler={show_straggler}")
        return "summary"


def issue_two_ops():
    comm.all_reduce(torch.ones(3))
    comm.broadcast(torch.ones(2), src=0, async_op=True).wait()


def _watched_run():
    comm.init_distributed(verbose=False)
    syncs, lookups = [], []
    real_sync, real_sys = comm._synchronize, comm.sys
    comm._synchronize = lambda: syncs.append(1) or real_sync()
    # the caller look-up is a stack walk starting at sys._getframe: count those
    comm.sys = types.SimpleNamespace(_getframe=lambda depth=0: lookups.append(1) or sys._getframe(depth + 1))
    out = {}
    try:
        issue_two_ops()  # nobody watches: no synchronization, no caller look-up
        out["unwatched"] = (len(syncs), len(lookups), comm.events.watching)
        ops, callers = Ops(), Callers()
        comm.events.register(ops)
        issue_two_ops()
        out["ops"] = list(ops.seen)
        out["without_caller"] = (len(syncs), len(lookups), comm.events.wants_caller)
        comm.events.register(callers)
        issue_two_ops()
        out["callers"] = list(callers.seen)
        comm.events.unregister(ops)
        comm.events.unregister(callers)
        syncs.clear(), lookups.clear()
        issue_two_ops()
        out["after"] = (len(syncs), len(lookups), comm.events.watching, comm.events.wants_caller)
    finally:
        comm._synchronize, comm.sys = real_sync, real_sys
    return out


def test_ops_are_reported_to_the_hook_and_cost_nothing_unwatched():
    for out in run_distributed(_watched_run, 2):
        assert out["unwatched"] == (0, 0, False)
        assert out["ops"] == [("all_reduce", 12, 2, False), ("broadcast", 8, 2, True)]
        # two ops, each synchronized before it starts and before it is reported; no caller wanted
        assert out["without_caller"] == (4, 0, False)
        assert out["callers"] == [("all_reduce", "issue_two_ops"), ("broadcast", "issue_two_ops")]
        assert out["after"] == (0, 0, False, False)


def test_log_summary_asks_the_summary_hook():
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        comm.log_summary()
    assert "no comms logger is active" in quiet.getvalue()
    summary = Summary()
    comm.events.register(summary)
    try:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            comm.log_summary(show_straggler=True)
        assert printed.getvalue() == "summary straggler=True\n"
    finally:
        comm.events.unregister(summary)


class ModuleLevel:
    """Stands for a plugin module implementing a comm hook at module level."""

    __name__ = "tests.module_level_comm"

    @hookimpl
    def dsplug_comm_op(self, op):
        pass


def test_module_level_implementations_are_installed_by_a_registry():
    from dsplug.registry import get_registry

    plugin = ModuleLevel()
    registry = make_registry(plugin)
    assert registry.comm_plugins() == [plugin]
    assert not [b for b in registry.broken if "dsplug_comm_op" in b[2]]  # a known hook, not a misspelling
    try:
        registry.install_comm_plugins()
        assert comm.events.is_registered(plugin) and comm.events.watching
    finally:
        get_registry().install_comm_plugins()  # the process-wide registry's own set again
    assert not comm.events.is_registered(plugin) and not comm.events.watching
