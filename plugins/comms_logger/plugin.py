"""Registers the comms logger: it owns the ``comms_logger`` config section.

Entry point: ``observer-comms-logger = "dsplug.plugins.comms_logger.plugin"``. With
``comms_logger.enabled`` the factory (:func:`.observer.build_observer`) registers a
:class:`~.logger.CommsRecorder`'s comm hooks (``dsplug_comm_op``, ``dsplug_comm_summary``) on the
engine's comm layer (``context.comm.events``); ``dsplug.comm.log_summary()`` prints its table;
closing the engine unregisters them. It also serves DeepSpeed's recorder class at
``deepspeed.utils.comms_logging`` (:mod:`.comms_logging`).
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, PluginSpec
from dsplug.hookspecs import hookimpl

from .config import CommsLoggerConfig
from .observer import build_observer


@hookimpl
def dsplug_observers():
    return [PluginSpec(
        category="observer",
        name="comms_logger",
        section="comms_logger",
        schema=CommsLoggerConfig,
        factory=build_observer,
        summary="count, size, latency and bandwidth of every collective; dsplug.comm.log_summary()",
    )]


@hookimpl
def dsplug_api_modules():
    """DeepSpeed's ``deepspeed.utils.comms_logging.CommsLogger`` (:mod:`.comms_logging`)."""
    return [ApiModule("dsplug.utils.comms_logging", "dsplug.plugins.comms_logger.comms_logging")]
