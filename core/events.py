"""An engine's event bus: a pluggy manager for the lifecycle hooks, whose failures name the plugin.

Every part that joins the bus (observers, monitors, the ZeRO stage, the precision, compression
methods, module-level lifecycle plugins) has its hook implementations wrapped so that an
exception escaping one is re-raised as :class:`PluginHookError` naming the plugin and the hook —
unless it is one of dsplug's own errors (checkpoint, communication, config, plugin errors), which already say
what is wrong and are re-raised unchanged.

Hooks are called through pluggy. Where the kernel must see each implementation's answer on its
own (to name the plugin that added a keyword, or to report one broken plugin and go on), it calls
them through :func:`call_each`, which passes each implementation the arguments it declares, as
pluggy does: nothing in dsplug calls a hook implementation any other way.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import pluggy

from .hookspecs import PROJECT, LifecycleSpecs


class PluginHookError(RuntimeError):
    """A plugin's lifecycle hook raised; the message names the plugin and the hook."""

    def __init__(self, message: str, plugin: str, hook: str):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook


def new_bus() -> pluggy.PluginManager:
    bus = pluggy.PluginManager(PROJECT)
    bus.add_hookspecs(LifecycleSpecs)
    return bus


def join(bus: pluggy.PluginManager, part, name: str) -> None:
    """Register ``part`` on ``bus`` under ``name`` (once) with failure-naming hook calls."""
    if bus.is_registered(part):
        return
    bus.register(part, name=name)
    for caller in bus.get_hookcallers(part) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is part and not getattr(impl.function, "_dsplug_named", False):
                impl.function = _naming_failures(impl.function, name, caller.name)


def _passes_through(exc: BaseException) -> bool:
    from .checkpoint import CheckpointError
    from .comm.faults import CommError
    from .config.schema import ConfigError
    from .registry import PluginError

    return isinstance(exc, (PluginHookError, CheckpointError, CommError, ConfigError, PluginError))


def _naming_failures(function, plugin: str, hook: str):
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            if _passes_through(exc):
                raise
            raise PluginHookError(f"plugin {plugin!r} raised in {hook}: {type(exc).__name__}: {exc}",
                                  plugin, hook) from exc

    call._dsplug_named = True
    return call


def call_impl(impl, kwargs: Mapping[str, Any]) -> Any:
    """Call one hook implementation (a pluggy ``HookImpl``) as pluggy would: with the arguments it
    declares (``impl.argnames``, any subset of the hook's), taken from ``kwargs``.

    The one place dsplug calls a hook implementation itself, for callers that must see each
    answer on its own (who added what) or survive one broken plugin. A hook wrapper cannot be
    called on its own: it is an error naming the plugin.
    """
    hook = impl.opts.get("specname") or getattr(impl.function, "__name__", "a hook")
    if impl.hookwrapper or impl.wrapper:
        raise PluginHookError(f"plugin {impl.plugin_name!r} implements {hook} as a hook wrapper; dsplug calls this "
                              "hook's implementations one at a time, so it must be a plain implementation",
                              impl.plugin_name, hook)
    missing = [name for name in impl.argnames if name not in kwargs]
    if missing:
        raise TypeError(f"{hook} was called without {', '.join(map(repr, missing))}, which plugin "
                        f"{impl.plugin_name!r} takes (the arguments given: {', '.join(kwargs) or 'none'})")
    return impl.function(*[kwargs[name] for name in impl.argnames])


def call_each(hook, kwargs: Mapping[str, Any], plugin: Optional[object] = None) -> Iterator[Tuple[Any, Any]]:
    """``(implementation, its answer)`` for each implementation of ``hook`` (a pluggy hook caller),
    called by :func:`call_impl` in pluggy's call order (``tryfirst`` / ``trylast`` honoured,
    otherwise the last registered first) when the iteration reaches it. ``plugin``: only that
    plugin's implementations."""
    for impl in reversed(hook.get_hookimpls()):
        if plugin is None or impl.plugin is plugin:
            yield impl, call_impl(impl, kwargs)


def forward_kwargs(bus: pluggy.PluginManager, engine, given: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``dsplug_forward_begin`` and return the model's forward keywords: ``given`` (the
    caller's, which win) plus those the implementations returned (each keyword from one plugin)."""
    extra: Dict[str, Any] = {}
    owner: Dict[str, str] = {}
    # one implementation at a time, to know who added what
    for impl, answer in call_each(bus.hook.dsplug_forward_begin, {"engine": engine}):
        for key, value in (answer or {}).items():
            if key in extra:
                raise PluginHookError(f"plugins {owner[key]!r} and {impl.plugin_name!r} both add the forward keyword "
                                      f"{key!r} (dsplug_forward_begin)", impl.plugin_name, "dsplug_forward_begin")
            extra[key], owner[key] = value, impl.plugin_name
    return {**extra, **given} if extra else given


def engine_methods(bus: pluggy.PluginManager, engine) -> Dict[str, Any]:
    """``{name: callable}`` the parts on the bus add to the engine (``dsplug_engine_methods``)."""
    methods: Dict[str, Any] = {}
    owner: Dict[str, str] = {}
    for impl, answer in call_each(bus.hook.dsplug_engine_methods, {"engine": engine}):
        for name, method in (answer or {}).items():
            if name in methods or hasattr(type(engine), name):
                other = owner.get(name, "the engine itself")
                raise PluginHookError(f"{impl.plugin_name!r} adds the engine method {name!r}, which {other!r} "
                                      f"already provides (dsplug_engine_methods)", impl.plugin_name,
                                      "dsplug_engine_methods")
            methods[name], owner[name] = method, impl.plugin_name
    return methods


#: what a ``dsplug_dataloader_options`` answer may hold
DATALOADER_OPTIONS = ("batch_sampler", "num_workers", "pin_memory")


def dataloader_options(bus: pluggy.PluginManager, engine, dataset, batch_size: int) -> Dict[str, Any]:
    """The DataLoader keywords one part returned from ``dsplug_dataloader_options`` ({} if none)."""
    found: Dict[str, Any] = {}
    owner = None
    arguments = {"engine": engine, "dataset": dataset, "batch_size": batch_size}
    for impl, options in call_each(bus.hook.dsplug_dataloader_options, arguments):
        if not options:
            continue
        if owner is not None:
            raise PluginHookError(f"plugins {owner!r} and {impl.plugin_name!r} both choose the training loader's "
                                  "sampling (dsplug_dataloader_options)", impl.plugin_name, "dsplug_dataloader_options")
        unknown = sorted(set(options) - set(DATALOADER_OPTIONS))
        if unknown or "batch_sampler" not in options:
            raise PluginHookError(f"{impl.plugin_name!r} returned DataLoader options {sorted(options)} from "
                                  f"dsplug_dataloader_options; expected 'batch_sampler' and optionally "
                                  f"{', '.join(DATALOADER_OPTIONS[1:])}", impl.plugin_name, "dsplug_dataloader_options")
        found, owner = dict(options), impl.plugin_name
    return found
