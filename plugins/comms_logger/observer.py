"""The engine observer that keeps a :class:`~.logger.CommsRecorder`'s comm hooks registered.

:func:`build_observer` (the spec's factory) registers the logger's ``dsplug_comm_op`` /
``dsplug_comm_summary`` hooks on the engine's comm layer (``context.comm.events``); closing the
engine unregisters them. Importing this module is cheap (the logger is imported when built).
"""
from __future__ import annotations

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl

from .config import DEEPSPEED_OPS, CommsLoggerConfig, selected_ops


class CommsLoggerObserver(Observer):
    """Engine observer keeping the logger's comm hooks registered for the engine's lifetime."""

    name = "comms_logger"

    def __init__(self, log, comm):
        from .logger import comm_hooks

        self.log = log  # the CommsRecorder (its records and summaries)
        self.comm = comm
        self.hooks = comm_hooks(log)
        comm.events.register(self.hooks, name=f"comms_logger:{id(self.hooks)}")

    def log_summary(self, show_straggler: bool = False) -> str:
        return self.log.log_summary(show_straggler=show_straggler)

    @hookimpl
    def dsplug_engine_closed(self, engine):
        if self.comm.events.is_registered(self.hooks):
            self.comm.events.unregister(self.hooks)


def build_observer(config, context):
    """``factory(config, context)``: the observer with its comm hooks registered, or None when disabled."""
    from dsplug.config.schema import parse
    from dsplug.logging import logger

    if config is None:
        return None
    if isinstance(config, dict):
        config = parse(CommsLoggerConfig, config, "comms_logger")
    if not config.enabled:
        return None
    if context.rank == 0:
        if config.prof_all and config.prof_ops:
            logger.warning("comms_logger: prof_all is true, so every op is logged and prof_ops "
                           f"{list(config.prof_ops)} has no effect; set prof_all to false to log only those")
        never = [n for n in config.prof_ops if DEEPSPEED_OPS[n] is None]
        if never and not config.prof_all:
            logger.warning(f"comms_logger.prof_ops: dsplug's comm layer never issues {', '.join(never)}; "
                           "nothing will be logged for them")
        if not config.prof_all and not selected_ops(config):
            logger.warning("comms_logger: prof_all is false and prof_ops names no op that dsplug issues, "
                           "so nothing will be logged")
    from .logger import CommsRecorder

    log = CommsRecorder(rank=context.rank, verbose=config.verbose, debug=config.debug,
                      ops=selected_ops(config), comm=context.comm)
    return CommsLoggerObserver(log, context.comm)
