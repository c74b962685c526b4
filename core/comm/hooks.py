"""``dsplug.comm.events``: the plugin manager of the comm hooks (:class:`dsplug.hookspecs.CommSpecs`).

Whatever wants to see the collectives (the comms logger, a byte counter in a benchmark) registers
an object with ``@dsplug.hookimpl`` implementations of ``dsplug_comm_op`` / ``dsplug_comm_summary``
here, like any pluggy plugin::

    dsplug.comm.events.register(counter)
    ...
    dsplug.comm.events.unregister(counter)

Installed plugins that implement a comm hook at module level are registered when the process-wide
registry is created (:func:`dsplug.registry.get_registry`).

The manager keeps two flags up to date on every (un)registration, which the comm layer reads
on each collective, so that watching costs nothing while nobody watches: ``watching`` (some
``dsplug_comm_op`` implementation is registered: the device is then synchronized around each op
so the latency covers its completion) and ``wants_caller`` (one of them takes the ``caller``
argument: only then is the issuing function looked up).
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import pluggy

from ..hookspecs import PROJECT, CommSpecs


class CommEvents(pluggy.PluginManager):
    def __init__(self):
        super().__init__(PROJECT)
        self.add_hookspecs(CommSpecs)
        #: some dsplug_comm_op implementation is registered
        self.watching = False
        #: some dsplug_comm_op implementation takes ``caller``
        self.wants_caller = False
        self._installed: List[object] = []

    def register(self, plugin, name: Optional[str] = None) -> Optional[str]:
        registered = super().register(plugin, name)
        self._refresh()
        return registered

    def unregister(self, plugin=None, name: Optional[str] = None):
        removed = super().unregister(plugin, name)
        self._refresh()
        return removed

    def _refresh(self) -> None:
        implementations = self.hook.dsplug_comm_op.get_hookimpls()
        self.watching = bool(implementations)
        self.wants_caller = any("caller" in impl.argnames for impl in implementations)

    def install(self, plugins: Iterable[object], names: Iterable[str]) -> None:
        """Register the installed plugins' module-level comm hooks (``plugins``, named ``names``),
        in place of those an earlier registry installed (``get_registry(refresh=True)``)."""
        for plugin in self._installed:
            if self.is_registered(plugin):
                self.unregister(plugin)
        self._installed = []
        for plugin, name in zip(plugins, names):
            if not self.is_registered(plugin):
                self.register(plugin, name=name)
                self._installed.append(plugin)
