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
from typing import Dict, Iterable, List, Optional, Tuple

import pluggy

from .descriptors import CATEGORIES, PluginSpec, Provided
from .hookspecs import CATEGORY_HOOKS, PROJECT, CategorySpecs, LifecycleSpecs

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


class Registry:
    """The set of installed plugins, as pluggy sees them."""

    def __init__(self, blocked: Optional[Iterable[str]] = None, entry_points=None):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(CategorySpecs)
        self.pm.add_hookspecs(LifecycleSpecs)
        self.blocked = tuple(blocked) if blocked is not None else blocked_from_env()
        self._blocked_lower = {_norm(b) for b in self.blocked}
        self.broken: List[Tuple[str, str, str]] = []  # (entry point, distribution, error)
        self.skipped: List[Tuple[str, str]] = []  # (what, why) blocked by the user
        self._origin: Dict[int, Tuple[str, str, str]] = {}  # id(plugin) -> (dist, version, ep)
        self._by_category: Dict[str, Dict[str, Provided]] = {c: {} for c in CATEGORIES}
        self._all: List[Provided] = []
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
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken third-party plugin must not take the kernel down
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

    def _broken(self, entry_point: str, distribution: str, exc: BaseException) -> None:
        self.broken.append((entry_point, distribution, f"{type(exc).__name__}: {exc}"))
        warnings.warn(f"dsplug plugin entry point {entry_point!r} from distribution {distribution!r} failed to "
                      f"load and is ignored: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)

    def register(self, plugin, distribution: str = "<runtime>", version: str = "0") -> None:
        """Register a plugin object directly (tests, notebooks) and re-collect specs."""
        self.pm.register(plugin, name=f"{distribution}:{getattr(plugin, '__name__', id(plugin))}")
        self._origin[id(plugin)] = (distribution, version, getattr(plugin, "__name__", "?"))
        self._collect()

    def _collect(self) -> None:
        self._by_category = {c: {} for c in CATEGORIES}
        self._all = []
        for category, hook_name in CATEGORY_HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                origin = self._origin.get(id(impl.plugin), ("<unknown>", "?", impl.plugin_name))
                try:
                    specs = impl.function() or []
                except Exception as exc:  # a plugin whose hook raises is reported, not fatal
                    self._broken(origin[2], origin[0], exc)
                    continue
                for spec in specs:
                    self._add(category, hook_name, spec, origin)

    def _add(self, category: str, hook_name: str, spec: PluginSpec, origin) -> None:
        dist, version, ep = origin
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
        if self._is_blocked(spec.name, f"{category}:{spec.name}"):
            self.skipped.append((f"{category}:{spec.name} ({dist})", BLOCK_ENV))
            return
        provided = Provided(spec=spec, distribution=dist, version=version, entry_point=ep)
        table = self._by_category[category]
        for name in spec.names():
            other = table.get(_norm(name))
            if other is not None and other.spec is not spec:
                raise PluginConflictError(
                    f"two plugins claim the {category} name {name!r}: one from distribution "
                    f"{other.distribution!r} (entry point {other.entry_point!r}) and one from "
                    f"distribution {dist!r} (entry point {ep!r}). Uninstall one, or block one "
                    f"with {BLOCK_ENV}={ep}"
                )
            table[_norm(name)] = provided
        self._all.append(provided)

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
        owners: Dict[str, Provided] = {}
        for provided in self._all:
            section = provided.spec.section
            if section is None:
                continue
            if section in owners and owners[section].spec is not provided.spec:
                other = owners[section]
                raise PluginConflictError(
                    f"two plugins claim the config section {section!r}: {other.category}:{other.name} "
                    f"from distribution {other.distribution!r} and {provided.category}:{provided.name} "
                    f"from distribution {provided.distribution!r}"
                )
            owners[section] = provided
        return owners

    def lifecycle_plugins(self) -> List[object]:
        """Registered plugins that implement any lifecycle hook directly."""
        names = [n for n in dir(LifecycleSpecs) if n.startswith("dsplug_")]
        found = []
        for name in names:
            for impl in getattr(self.pm.hook, name).get_hookimpls():
                if impl.plugin not in found:
                    found.append(impl.plugin)
        return found


_REGISTRY: Optional[Registry] = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, discovered on first use (``refresh=True`` rescans)."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry()
    return _REGISTRY
