"""Discovers plugins from the ``dsplug`` entry-point group and answers ``get(category, name)``.

Rules:
* every plugin, built-in or third-party, arrives through an entry point;
* two plugins claiming the same name (or alias) in one category is an error naming both
  providing distributions;
* ``DSPLUG_BLOCK_PLUGINS`` (comma separated) blocks plugins by entry-point name, distribution
  name, plugin name or ``category:name``;
* a miss gives a did-you-mean and the list of installed names.
"""
from __future__ import annotations

import difflib
import os
import sys
import warnings
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pluggy

from .descriptors import CATEGORIES, ApiModule, CliCommand, PluginSpec, Provided
from .events import call_impl
from .hookspecs import CATEGORY_HOOKS, PROJECT, CategorySpecs, CommSpecs, LifecycleSpecs, ServiceSpecs

if sys.version_info >= (3, 10):
    from importlib.metadata import entry_points as _entry_points

    def _dsplug_entry_points():
        return _entry_points(group=PROJECT)

else:  # pragma: no cover - exercised only on 3.9
    from importlib_metadata import entry_points as _entry_points

    def _dsplug_entry_points():
        return _entry_points(group=PROJECT)


BLOCK_ENV = "DSPLUG_BLOCK_PLUGINS"


class PluginError(Exception):
    """A problem with the set of installed plugins or with selecting one."""


def run_plugin_code(fn):
    """``fn()`` -> ``(result, None)``, or ``(None, exc)`` when plugin code raised anything — any
    :class:`BaseException` too (``SystemExit``, ``GeneratorExit``, a ``KeyboardInterrupt`` the
    plugin raised itself) — so that one broken plugin never takes the kernel down.

    The user's real Ctrl-C is not contained: while ``fn`` runs in the main thread a SIGINT handler
    notes that a signal arrived (and then does what the previous handler does); a
    ``KeyboardInterrupt`` is re-raised exactly when a SIGINT was seen. Elsewhere than in the main
    thread no signal can raise there, so a ``KeyboardInterrupt`` is always the plugin's own."""
    import signal
    import threading

    seen = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)

        def noting(signum, frame):
            seen.append(signum)
            if callable(previous):
                return previous(signum, frame)
            if previous == signal.SIG_DFL:
                return signal.default_int_handler(signum, frame)
            return None  # SIG_IGN

        try:
            if previous is not None:  # None: a handler not set from Python, which cannot be restored
                signal.signal(signal.SIGINT, noting)
        except (ValueError, OSError):  # not allowed here: leave the handler alone
            previous = None
    try:
        return fn(), None
    except KeyboardInterrupt as exc:
        if seen:
            raise
        return None, exc
    except BaseException as exc:  # noqa: BLE001 - contained: the caller reports the plugin as broken
        return None, exc
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


class PluginConflictError(PluginError):
    pass


class PluginNotFoundError(PluginError, LookupError):
    def __init__(self, message: str, category: str, name: str, installed: List[str]):
        super().__init__(message)
        self.category = category
        self.name = name
        self.installed = installed


def _norm(name: str) -> str:
    return str(name).strip().lower()


def suggest(word: str, candidates: Iterable[str]) -> Optional[str]:
    """Closest candidate to ``word`` (case-insensitive), or None."""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    hit = difflib.get_close_matches(str(word).lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hit[0]] if hit else None


def blocked_from_env(environ=None) -> Tuple[str, ...]:
    raw = (environ if environ is not None else os.environ).get(BLOCK_ENV, "")
    return tuple(item.strip() for item in raw.split(",") if item.strip())


_DISCOVERING = 0  # Registry objects being built: their plugin modules are being imported


def discovering() -> bool:
    """Whether plugin modules are being imported by a registry being built (the import finder of
    :mod:`dsplug.api_paths` cannot consult the registry then)."""
    return _DISCOVERING > 0


class Registry:
    """The set of installed plugins, as pluggy sees them."""

    block_env = BLOCK_ENV

    def __init__(self, blocked: Optional[Iterable[str]] = None, entry_points=None):
        global _DISCOVERING
        _DISCOVERING += 1
        try:
            self._discover(blocked, entry_points)
        finally:
            _DISCOVERING -= 1

    def _discover(self, blocked, entry_points) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(CategorySpecs)
        self.pm.add_hookspecs(ServiceSpecs)
        self.pm.add_hookspecs(LifecycleSpecs)
        self.pm.add_hookspecs(CommSpecs)
        self.blocked = tuple(blocked) if blocked is not None else blocked_from_env()
        self._blocked_lower = {_norm(b) for b in self.blocked}
        self.broken: List[Tuple[str, str, str]] = []  # (entry point, distribution, error)
        self.skipped: List[Tuple[str, str]] = []  # (what, why) blocked by the user
        self._origin: Dict[int, Tuple[str, str, str]] = {}  # id(plugin) -> (dist, version, ep)
        self._by_category: Dict[str, Dict[str, Provided]] = {c: {} for c in CATEGORIES}
        self._all: List[Provided] = []
        self._api_paths: Optional[Dict[str, List[Tuple[ApiModule, Tuple[str, str, str]]]]] = None
        self._api_packages: Set[str] = set()
        self._load(_dsplug_entry_points() if entry_points is None else entry_points)
        self._collect()

    # ---------------------------------------------------------------- discovery
    def _is_blocked(self, *names: str) -> bool:
        return any(_norm(n) in self._blocked_lower for n in names if n)

    def _load(self, eps) -> None:
        seen = set()
        for ep in eps:
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
            version = dist.version if dist is not None else "?"
            key = (ep.name, ep.value)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            if self._is_blocked(ep.name, dist_name):
                self.skipped.append((f"entry point {ep.name} ({dist_name})", BLOCK_ENV))
                continue
            plugin, exc = run_plugin_code(ep.load)  # a broken third-party plugin must not take the kernel down
            if exc is not None:
                self._broken(ep.name, dist_name, exc)
                continue
            if self.pm.is_registered(plugin):
                continue
            try:
                self.pm.register(plugin, name=f"{dist_name}:{ep.name}")
            except Exception as exc:  # e.g. a hook implementation whose signature matches no spec
                self._broken(ep.name, dist_name, exc)
                continue
            self._origin[id(plugin)] = (dist_name, version, ep.name)
            self._check_hook_names(plugin, ep.name, dist_name)

    def _check_hook_names(self, plugin, entry_point: str, distribution: str) -> None:
        """Report ``dsplug_*`` functions that pluggy will never call: a name that matches no hook
        (misspelled), or a hook function missing its ``@hookimpl`` marker."""
        known = {n for n in dir(self.pm.hook) if n.startswith("dsplug_")}
        for attr in dir(plugin):
            if not attr.startswith("dsplug_") or not callable(getattr(plugin, attr, None)):
                continue
            marked = self.pm.parse_hookimpl_opts(plugin, attr) is not None
            if attr not in known or not self.pm.hook.__dict__[attr].has_spec():
                guess = suggest(attr, [n for n in known if self.pm.hook.__dict__[n].has_spec()])
                self._broken(entry_point, distribution, PluginError(
                    f"{attr} matches no dsplug hook, so it is never called" +
                    (f"; did you mean {guess}?" if guess else "")), fatal=False)
            elif not marked:
                self._broken(entry_point, distribution, PluginError(
                    f"{attr} is not decorated with @dsplug.hookimpl, so it is never called"), fatal=False)

    def _broken(self, entry_point: str, distribution: str, exc: BaseException, fatal: bool = True) -> None:
        """Record a problem with a plugin. ``fatal``: the plugin (or the part that failed) is ignored."""
        self.broken.append((entry_point, distribution, f"{type(exc).__name__}: {exc}"))
        what = "failed to load and is ignored" if fatal else "has a problem"
        warnings.warn(f"dsplug plugin entry point {entry_point!r} from distribution {distribution!r} {what}: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)

    def register(self, plugin, distribution: str = "<runtime>", version: str = "0") -> None:
        """Register a plugin object directly (tests, notebooks) and re-collect specs."""
        self.pm.register(plugin, name=f"{distribution}:{getattr(plugin, '__name__', id(plugin))}")
        self._origin[id(plugin)] = (distribution, version, getattr(plugin, "__name__", "?"))
        self._api_paths = None
        self._collect()

    def _collect(self) -> None:
        self._by_category = {c: {} for c in CATEGORIES}
        self._all = []
        self.conflicts: Dict[Tuple[str, str], str] = {}
        specs_of: Dict[Tuple[str, str, str], List[Tuple[str, bool]]] = {}  # origin -> (spec, blocked)
        for category, hook_name in CATEGORY_HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            # dsplug's own plugins first, then registration order: on a conflict the first claim stays
            for impl in sorted(hook.get_hookimpls(), key=lambda i: self._origin.get(id(i.plugin), ("",))[0] != PROJECT):
                origin = self._origin.get(id(impl.plugin), ("<unknown>", "?", impl.plugin_name))
                specs, exc = run_plugin_code(lambda: list(call_impl(impl, {}) or []))
                if exc is None:
                    try:
                        for spec in specs:
                            self._check_spec(category, hook_name, spec, origin)
                    except Exception as error:  # a plugin whose hook returns junk is reported, not fatal
                        exc = error
                if exc is not None:
                    self._broken(origin[2], origin[0], exc)
                    continue
                for spec in specs:
                    blocked = self._add(category, spec, origin)
                    specs_of.setdefault(origin, []).append((f"{category}:{spec.name}", blocked))
        #: origin -> its specs, for plugins whose every spec is blocked (their import paths are too)
        self._blocked_plugins = {origin: [name for name, _ in specs] for origin, specs in specs_of.items()
                                 if all(blocked for _, blocked in specs)}

    @staticmethod
    def _check_spec(category: str, hook_name: str, spec, origin) -> None:
        dist, _version, ep = origin
        if not isinstance(spec, PluginSpec):
            raise PluginError(
                f"plugin {ep!r} from distribution {dist!r} returned {spec!r} from {hook_name}; "
                "expected dsplug.PluginSpec objects"
            )
        if spec.category != category:
            raise PluginError(
                f"plugin {ep!r} from distribution {dist!r} returned a {spec.category!r} spec "
                f"named {spec.name!r} from {hook_name}, which is for category {category!r}"
            )

    def _add(self, category: str, spec: PluginSpec, origin) -> bool:
        """Add one spec; True when the blocklist skips it. A name (or section) already claimed by
        another distribution is a conflict: the later claim is skipped and reported, and selecting
        that name is an error naming both."""
        dist, version, ep = origin
        if self._is_blocked(spec.name, f"{category}:{spec.name}"):
            self.skipped.append((f"{category}:{spec.name} ({dist})", BLOCK_ENV))
            return True
        provided = Provided(spec=spec, distribution=dist, version=version, entry_point=ep)
        table = self._by_category[category]
        claims = [(category, _norm(n), f"the {category} name {n!r}", table.get(_norm(n))) for n in spec.names()]
        if spec.section:
            owner = next((p for p in self._all if p.spec.section == spec.section), None)
            claims.append(("section", spec.section, f"the config section {spec.section!r}", owner))
        clashes = [(key, what, other) for kind, key, what, other in claims if other is not None and other.spec is not spec]
        if clashes:
            for key, what, other in clashes:
                kind = "section" if what.startswith("the config section") else category
                message = (f"two plugins claim {what}: {other.category}:{other.name} from distribution "
                           f"{other.distribution!r} (entry point {other.entry_point!r}) and {category}:{spec.name} "
                           f"from distribution {dist!r} (entry point {ep!r}). Uninstall one, or block one with "
                           f"{BLOCK_ENV}={ep}")
                self.conflicts[(kind, key)] = message
                self._broken(ep, dist, PluginConflictError(message))
            return False
        for name in spec.names():
            table[_norm(name)] = provided
        self._all.append(provided)
        return False

    # ---------------------------------------------------------------- queries
    def all(self) -> List[Provided]:
        return list(self._all)

    def names(self, category: str) -> List[str]:
        return sorted({p.spec.name for p in self._by_category[category].values()}, key=str.lower)

    def find(self, category: str, name) -> Optional[Provided]:
        if category not in self._by_category:
            raise PluginError(f"unknown plugin category {category!r}; categories: {', '.join(CATEGORIES)}")
        return self._by_category[category].get(_norm(name))

    def get(self, category: str, name, what: Optional[str] = None) -> Provided:
        """The plugin selected by ``name`` in ``category``; a clear error on a miss.

        ``what`` names the config key that asked (``"optimizer.type"``) for the message.
        """
        conflict = self.conflicts.get((category, _norm(name)))
        if conflict is not None:
            raise PluginConflictError(conflict)
        found = self.find(category, name)
        if found is not None:
            return found
        raise PluginNotFoundError(self.miss_message(category, name, what), category, str(name), self.names(category))

    def miss_message(self, category: str, name, what: Optional[str] = None) -> str:
        installed = self.names(category)
        aliases = [n for p in self._by_category[category].values() for n in p.spec.names()]
        guess = suggest(str(name), aliases)
        where = f"{what} = {name!r}" if what else f"{category} {name!r}"
        msg = f"{where}: no {category} plugin named {name!r} is installed."
        if guess:
            msg += f" Did you mean {guess!r}?"
        msg += f" Installed {category} plugins: {', '.join(installed) if installed else '(none)'}."
        blocked = [s for s, _ in self.skipped if str(name).lower() in s.lower()]
        if blocked:
            msg += f" ({blocked[0]} is blocked by {BLOCK_ENV}.)"
        return msg

    def section_owner(self, section: str) -> Optional[Provided]:
        for provided in self._all:
            if provided.spec.section == section:
                return provided
        return None

    def sections(self) -> Dict[str, Provided]:
        """Top-level config section -> the plugin that owns its schema."""
        return {p.spec.section: p for p in self._all if p.spec.section is not None}

    # ---------------------------------------------------------------- services
    def origin(self, plugin) -> Tuple[str, str, str]:
        """``(distribution, version, entry point)`` of a registered plugin object."""
        return self._origin.get(id(plugin), ("<unknown>", "?", self.pm.get_name(plugin) or "?"))

    def _service_results(self, hook_name: str, kind: type):
        """``(item, origin)`` for every item the service hook returns; a plugin whose hook raises
        or returns something else is reported as broken, not fatal."""
        out = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            origin = self.origin(impl.plugin)
            items, exc = run_plugin_code(lambda: list(call_impl(impl, {}) or []))  # one bad plugin never takes dsplug down
            bad = [i for i in items or () if not isinstance(i, kind)]
            if exc is None and bad:
                exc = PluginError(f"{hook_name} returned {bad[0]!r}; expected {kind.__module__}.{kind.__name__}")
            if exc is not None:
                self._broken(origin[2], origin[0], exc)
                continue
            out.extend((item, origin) for item in items)
        return out

    def cli_commands(self) -> List[Tuple[CliCommand, Tuple[str, str, str]]]:
        """Subcommands plugins contribute, first claim of each name kept."""
        seen: Dict[str, Tuple[str, str, str]] = {}
        out = []
        for command, origin in self._service_results("dsplug_cli_commands", CliCommand):
            if command.name in seen:
                self._broken(origin[2], origin[0], PluginConflictError(
                    f"the command 'dsplug {command.name}' is already provided by distribution {seen[command.name][0]!r}"))
                continue
            seen[command.name] = origin
            out.append((command, origin))
        return out

    def api_paths(self) -> Dict[str, List[Tuple[ApiModule, Tuple[str, str, str]]]]:
        """DeepSpeed import path -> ``(ApiModule, origin)`` of each plugin declaring it
        (``dsplug_api_modules``), dsplug's own first. Served by :mod:`dsplug.api_paths`."""
        if self._api_paths is None:
            table: Dict[str, List[Tuple[ApiModule, Tuple[str, str, str]]]] = {}
            declared = self._service_results("dsplug_api_modules", ApiModule)
            self.blocked_api_paths: Dict[str, str] = {}  # path -> why, for plugins whose specs are all blocked
            for module, origin in sorted(declared, key=lambda item: item[1][0] != PROJECT):
                blocked = self._blocked_plugins.get(origin)
                if blocked is not None:
                    self.blocked_api_paths[module.path] = (f"its plugin {origin[2]!r} ({origin[0]}) is blocked by "
                                                           f"{BLOCK_ENV} ({', '.join(blocked)})")
                    continue
                table.setdefault(module.path, []).append((module, origin))
            self._api_paths = table
            self._api_packages = {".".join(path.split(".")[:i]) for path in table for i in range(2, path.count(".") + 1)}
        return self._api_paths

    def api_packages(self) -> Set[str]:
        """Every package above a declared import path (``dsplug.runtime`` for ``dsplug.runtime.pipe``)."""
        self.api_paths()
        return self._api_packages

    def lifecycle_plugins(self) -> List[object]:
        """Registered plugins that implement any lifecycle hook directly."""
        names = [n for n in dir(LifecycleSpecs) if n.startswith("dsplug_")]
        found = []
        for name in names:
            for impl in getattr(self.pm.hook, name).get_hookimpls():
                if impl.plugin not in found:
                    found.append(impl.plugin)
        return found


    def comm_plugins(self) -> List[object]:
        """Registered plugins that implement a comm hook (:class:`dsplug.hookspecs.CommSpecs`) directly."""
        found = []
        for name in (n for n in dir(CommSpecs) if n.startswith("dsplug_")):
            for impl in getattr(self.pm.hook, name).get_hookimpls():
                if impl.plugin not in found:
                    found.append(impl.plugin)
        return found

    def install_comm_plugins(self) -> None:
        """Register :meth:`comm_plugins` on :data:`dsplug.comm.events` (in place of an earlier
        registry's); the comm layer (and torch) is imported only when there is something to do."""
        plugins = self.comm_plugins()
        if not plugins and "dsplug.comm" not in sys.modules:
            return
        from .comm import events

        events.install(plugins, [self.pm.get_name(p) for p in plugins])


_REGISTRY: Optional[Registry] = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, discovered on first use (``refresh=True`` rescans)."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry()
        _REGISTRY.install_comm_plugins()  # module-level comm hooks see every collective of the process
    return _REGISTRY
