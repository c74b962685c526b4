"""The import side of the alias: ``deepspeed`` and ``deepspeed.X`` resolve to ``dsplug`` and ``dsplug.X``.

The site-packages shim ``deepspeed/__init__.py`` written by ``dsplug deepspeed-alias enable`` calls
:func:`install`, which puts an :class:`AliasFinder` first on ``sys.meta_path`` and replaces
``sys.modules["deepspeed"]`` by ``dsplug`` (the import statement returns what ``sys.modules``
holds once the shim has run). Each ``deepspeed.X`` is then served the very module object
``dsplug.X`` -- never a second copy, so module state (the comm layer's process group, the
registry) is shared whichever name a library uses.

``deepspeed.X`` is found exactly where ``dsplug.X`` is, by the same finders: kernel modules, the
import paths plugins declare (:mod:`dsplug.api_paths`), and the errors that explain a missing one
-- :class:`dsplug.unavailable.ModuleNotAvailableInDsplug` for a DeepSpeed module dsplug does not
implement, :class:`dsplug.api_paths.ApiPathError` for a blocked plugin's path. Any other missing
name is an ordinary ``ModuleNotFoundError``.

Cheap to import: nothing here imports torch.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

ALIAS = "deepspeed"
TARGET = "dsplug"


def target_name(fullname: str) -> str:
    """``deepspeed.runtime.lr_schedules`` -> ``dsplug.runtime.lr_schedules``."""
    return TARGET + fullname[len(ALIAS):]


class AliasLoader(importlib.abc.Loader):
    """Hands the import system the already-imported ``dsplug`` module instead of creating one.

    The import system stamps ``__spec__`` of whatever ``create_module`` returns with the alias
    spec; ``exec_module`` puts the module's own spec back, so ``dsplug.X.__spec__.name`` stays
    ``dsplug.X`` (reload, pickling by reference and ``python -m`` keep working).
    """

    def __init__(self, target: str):
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module) -> None:
        if self._own_spec is not None:
            try:
                module.__spec__ = self._own_spec
            except AttributeError:  # pragma: no cover - a module type refusing the attribute
                pass


def _explains(exc: ImportError) -> bool:
    """Whether ``exc`` is one of the explaining errors of dsplug's own import finder."""
    from dsplug.api_paths import ApiPathError
    from dsplug.unavailable import NotAvailableInDsplug

    return isinstance(exc, (ApiPathError, NotAvailableInDsplug))


class AliasFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder for ``deepspeed`` and ``deepspeed.*`` (first on ``sys.meta_path``)."""

    dsplug_deepspeed_alias = True  # marks instances across reloads of this module

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = target_name(fullname)
        module = sys.modules.get(real)
        if module is not None:
            real_spec = getattr(module, "__spec__", None)
            is_package = hasattr(module, "__path__")
        else:
            try:
                real_spec = importlib.util.find_spec(real)
            except ModuleNotFoundError as exc:
                if _explains(exc):
                    raise  # dsplug's finder says why (a feature dsplug lacks, a blocked plugin)
                real_spec = None  # a parent dsplug module is missing
            if real_spec is None:
                return None  # the ordinary "No module named 'deepspeed.X'"
            is_package = real_spec.submodule_search_locations is not None
        origin = getattr(real_spec, "origin", None)
        return importlib.machinery.ModuleSpec(fullname, AliasLoader(real), origin=origin, is_package=is_package)


def installed() -> bool:
    return any(getattr(f, "dsplug_deepspeed_alias", False) for f in sys.meta_path)


def install():
    """Put the finder first on ``sys.meta_path`` (once) and make ``deepspeed`` name ``dsplug``.

    Returns the ``dsplug`` module. Called by the site-packages shim; safe to call again.
    """
    if not installed():
        sys.meta_path.insert(0, AliasFinder())
    dsplug = importlib.import_module(TARGET)
    sys.modules[ALIAS] = dsplug
    return dsplug


def uninstall() -> None:
    """Undo :func:`install` in this process (tests; the files on disk are ``disable``'s job)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "dsplug_deepspeed_alias", False)]
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        module = sys.modules[name]
        if module is not None and getattr(module, "__name__", None) == target_name(name):
            del sys.modules[name]
