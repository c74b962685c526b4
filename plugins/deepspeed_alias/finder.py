"""The import side of the alias: ``deepspeed`` and ``deepspeed.X`` resolve to ``dsplug`` and ``dsplug.X``.

The site-packages shim ``deepspeed/__init__.py`` written by ``dsplug deepspeed-alias enable`` calls
:func:`install`, which puts an :class:`AliasFinder` first on ``sys.meta_path`` and replaces
``sys.modules["deepspeed"]`` by a :class:`DeepSpeedModule` (the import statement returns what
``sys.modules`` holds once the shim has run). Each ``deepspeed.X`` is then served the very module
object ``dsplug.X`` -- never a second copy, so module state (the comm layer's process group, the
registry) is shared whichever name a library uses.

``deepspeed`` itself is dsplug's namespace under DeepSpeed's name: every attribute is ``dsplug``'s
(``deepspeed.initialize is dsplug.initialize``; setting one sets dsplug's), except the version:
``deepspeed.__version__`` is the alias distribution's (``0.19.8+dsplug.0.1.0``, what
``importlib.metadata.version("deepspeed")`` says), as code comparing DeepSpeed versions expects,
while ``dsplug.__version__`` stays dsplug's.

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
import types

ALIAS = "deepspeed"
TARGET = "dsplug"


def target_name(fullname: str) -> str:
    """``deepspeed.runtime.lr_schedules`` -> ``dsplug.runtime.lr_schedules``."""
    return TARGET + fullname[len(ALIAS):]


def alias_distribution_version() -> str:
    """The version of the ``deepspeed`` distribution the alias wrote (``0.19.8+dsplug.0.1.0``); what
    this dsplug would write when the metadata cannot be read."""
    from .install import alias_version, is_alias_version

    try:
        import importlib.metadata

        version = importlib.metadata.version(ALIAS)
    except Exception:  # noqa: BLE001 - no metadata (in-process use, a broken dist-info)
        version = None
    return version if version and is_alias_version(version) else alias_version()


class DeepSpeedModule(types.ModuleType):
    """``deepspeed``: ``dsplug``'s attributes under DeepSpeed's name, DeepSpeed's version numbers."""

    def __init__(self, dsplug: types.ModuleType, version: str):
        super().__init__(ALIAS, dsplug.__doc__)
        own = self.__dict__
        own["_dsplug"] = dsplug
        own["__spec__"] = importlib.machinery.ModuleSpec(ALIAS, None, origin=getattr(dsplug, "__file__", None),
                                                         is_package=True)
        own["__spec__"].submodule_search_locations = list(getattr(dsplug, "__path__", []))
        own["__path__"] = own["__spec__"].submodule_search_locations
        own["__file__"] = getattr(dsplug, "__file__", None)
        own["__version__"] = version
        numbers = [int(part) if part.isdigit() else 0 for part in version.split("+")[0].split(".")[:3]]
        own["__version_major__"], own["__version_minor__"], own["__version_patch__"] = (numbers + [0, 0, 0])[:3]
        # DeepSpeed's build-time git state: dsplug records none (deepspeed.git_version_info says the same)
        own["__git_hash__"] = own["__git_branch__"] = "unknown"

    def __getattr__(self, name):
        return getattr(self.__dict__["_dsplug"], name)

    def __setattr__(self, name, value):
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.__dict__["_dsplug"], name, value)

    def __delattr__(self, name):
        if name in self.__dict__:
            del self.__dict__[name]
        else:
            delattr(self.__dict__["_dsplug"], name)

    def __dir__(self):
        return sorted(set(dir(self.__dict__["_dsplug"])) | {k for k in self.__dict__ if k != "_dsplug"})

    def __repr__(self) -> str:
        return f"<module 'deepspeed' (dsplug {self.__dict__['_dsplug'].__version__}, alias {self.__version__})>"


def deepspeed_module() -> DeepSpeedModule:
    """The ``deepspeed`` module object (one per process)."""
    current = sys.modules.get(ALIAS)
    if isinstance(current, DeepSpeedModule):
        return current
    return DeepSpeedModule(importlib.import_module(TARGET), alias_distribution_version())


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
        if self.target == TARGET:  # ``deepspeed`` itself
            return deepspeed_module()
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
    """Put the finder first on ``sys.meta_path`` (once) and make ``deepspeed`` name ``dsplug``'s
    namespace (:class:`DeepSpeedModule`).

    Returns the ``deepspeed`` module. Called by the site-packages shim; safe to call again.
    """
    if not installed():
        sys.meta_path.insert(0, AliasFinder())
    module = deepspeed_module()
    sys.modules[ALIAS] = module
    return module


def uninstall() -> None:
    """Undo :func:`install` in this process (tests; the files on disk are ``disable``'s job)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "dsplug_deepspeed_alias", False)]
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        module = sys.modules[name]
        if isinstance(module, DeepSpeedModule) or (
                module is not None and getattr(module, "__name__", None) == target_name(name)):
            del sys.modules[name]
