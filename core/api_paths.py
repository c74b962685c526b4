"""DeepSpeed's import paths whose names a plugin provides (``dsplug.zero``, ``dsplug.moe.layer``),
served by one import finder.

A plugin declares a path with the ``dsplug_api_modules`` hook::

    @hookimpl
    def dsplug_api_modules():
        return [ApiModule("dsplug.moe.layer", "dsplug.plugins.moe.layer")]

and ``import dsplug.moe.layer`` / ``from dsplug.moe.layer import MoE`` then work: the kernel holds
no file there. :class:`ApiPathFinder` (first on ``sys.meta_path``, put there by ``import dsplug``)
answers every ``dsplug.*`` module that is not a kernel module:

* a declared path becomes a module named after the path whose names are those of the declaring
  plugin's module (``target``), looked up on first access (classes, functions and modules are
  then kept on the module; other values are read live, so none goes stale); ``dir()`` lists
  them, ``inspect.getsource`` shows the target's source, and the objects are the plugin's own
  (``dsplug.moe.MoE is dsplug.plugins.moe.layer.MoE``; pickles refer to the plugin module);
* each parent of a declared path (``dsplug.runtime.pipe``, ``dsplug.launcher``) is a package;
  its children are its attributes, imported on first access;
* a DeepSpeed module dsplug does not implement raises the error of :mod:`dsplug.unavailable`;
* a path no loaded plugin declares while ``DSPLUG_BLOCK_PLUGINS`` blocks some raises
  :class:`ApiPathError` naming the blocked plugins.

Kernel code always wins: a kernel module at a path is served by the ordinary path finder, and
the names of such a module stay the kernel's. A kernel module at a DeepSpeed path that plugins
may add names or children to ends with ``__getattr__, __dir__ = plugin_names(__name__)``: its
missing attributes resolve to its child modules (kernel or declared) and to the names plugins
declare at its path (``dsplug.ops.adam.FusedAdam`` from the Adam optimizer plugin).

Several plugins may declare one path: a name comes from the first declarer that has it
(dsplug's own plugins first). Nothing here imports torch or any plugin until a path that needs
one is imported; deciding that a ``dsplug.*`` import is a kernel module needs no plugin at all.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pkgutil
import sys
import types
from typing import Callable, List, Tuple

PACKAGE = "dsplug"
#: subpackages the finder never serves (the built-in plugins and the C++ sources)
_NOT_PATHS = ("dsplug.plugins", "dsplug.csrc")


class ApiPathError(ModuleNotFoundError):
    """A ``dsplug.*`` import path that no loaded plugin declares, or whose plugin fails to import."""


def _registry():
    from . import registry

    if registry.discovering():
        return None
    return registry.get_registry()


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _targets(name: str) -> List[types.ModuleType]:
    """The modules of the plugins declaring ``name``, imported; a failing one is named."""
    reg = _registry()
    out = []
    for api, (dist, _version, entry_point) in (reg.api_paths().get(name, []) if reg is not None else []):
        try:
            out.append(importlib.import_module(api.target))
        except ImportError as exc:
            raise ApiPathError(f"{name} is provided by {api.target} (plugin {entry_point!r} from distribution "
                               f"{dist!r}), which failed to import: {exc}", name=name) from exc
    return out


#: values cached on the module at first access; the others (settings, state) are read live each time
_DEFINITIONS = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)


def _public(module) -> List[str]:
    return [n for n in dir(module) if not n.startswith("_")]


def _children(name: str) -> List[str]:
    """Last segments of the declared paths (and parents of ones) directly below ``name``."""
    reg = _registry()
    if reg is None:
        return []
    prefix = name + "."
    found = set(reg.api_paths()) | reg.api_packages()
    return sorted({p[len(prefix):] for p in found if p.startswith(prefix) and "." not in p[len(prefix):]})


def _lookup(name: str, attr: str, children, targets: List[types.ModuleType]):
    """``name.attr`` after the module's own names: a child import path first (DeepSpeed's
    submodules are attributes of their package), then the plugins' names. ``children``: the last
    segments of the child paths."""
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")
    if attr in children:
        return importlib.import_module(f"{name}.{attr}")
    for target in targets:
        try:
            value = getattr(target, attr)
        except AttributeError:
            continue
        if isinstance(value, _DEFINITIONS):  # never rebound: later lookups skip this function
            setattr(sys.modules[name], attr, value)
        return value
    where = f" (its names come from {', '.join(t.__name__ for t in targets)})" if targets else ""
    reg = _registry()
    if reg is not None and reg.skipped:
        where += f"; {reg.block_env} blocks {'; '.join(what for what, _why in reg.skipped)}"
    raise AttributeError(f"module {name!r} has no attribute {attr!r}{where}")


# --------------------------------------------------------------------------- the finder
class ApiPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``dsplug.*`` import paths that plugins declare (see the module docstring)."""

    dsplug_api_paths = True  # marks instances across reloads of this module

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + ".") or _under(fullname, _NOT_PATHS):
            return None
        kernel = importlib.machinery.PathFinder.find_spec(fullname, path)
        if kernel is not None and kernel.loader is not None:
            return kernel  # a kernel module: served as the path finder would
        reg = _registry()
        if reg is None:
            raise ApiPathError(f"{fullname} is an import path plugins provide, imported while the plugins are being "
                               "discovered: a plugin module must import it inside the function that uses it, not "
                               "at import time", name=fullname)
        declared = reg.api_paths().get(fullname)
        if declared is not None or fullname in reg.api_packages():
            if declared:
                api, (dist, _version, entry_point) = declared[0]
                origin = f"provided by {api.target} (plugin {entry_point!r}, distribution {dist!r})"
            else:
                origin = "parent package of import paths plugins provide"
            return importlib.machinery.ModuleSpec(fullname, self, origin=origin,
                                                  is_package=fullname in reg.api_packages())
        from .unavailable import module_error

        error = module_error(fullname)
        if error is not None:
            raise error
        if kernel is not None:
            return kernel  # a namespace package of the kernel's
        why = reg.blocked_api_paths.get(fullname)
        if why is not None:
            raise ApiPathError(f"No module named {fullname!r}: {why}. Unblock it to import this path.", name=fullname)
        if reg.skipped:
            blocked = "; ".join(what for what, _why in reg.skipped)
            raise ApiPathError(f"No module named {fullname!r}: no loaded plugin declares this import path "
                               f"(dsplug_api_modules), and {reg.block_env} blocks {blocked}. If one of those "
                               "provides it, unblock it; `dsplug list` shows what is installed.", name=fullname)
        return None

    def create_module(self, spec):
        return None  # an ordinary module object

    def exec_module(self, module) -> None:
        name = module.__name__
        targets = _targets(name)
        children = frozenset(_children(name))

        def __getattr__(attr):
            return _lookup(name, attr, children, targets)

        def __dir__():
            names = set(module.__dict__) | children
            for target in targets:
                names.update(_public(target))
            return sorted(n for n in names if not (n.startswith("__") and n.endswith("__")))

        module.__getattr__ = __getattr__
        module.__dir__ = __dir__
        if targets:
            first = targets[0]
            module.__doc__ = first.__doc__
            if getattr(first, "__file__", None):
                module.__file__ = first.__file__  # inspect.getsource(dsplug.moe) shows the provider's source
            names: List[str] = []
            for target in targets:
                declared = getattr(target, "__all__", None)
                if declared is None:
                    declared = [n for n in _public(target) if not isinstance(getattr(target, n), types.ModuleType)]
                names += [n for n in declared if n not in names]
            module.__all__ = names
        else:
            module.__doc__ = f"Parent package of DeepSpeed import paths plugins provide: {', '.join(_children(name))}."


def plugin_names(module_name: str) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for the kernel module ``module_name`` at a DeepSpeed path that
    plugins may extend: a missing attribute resolves to a child module (the kernel's or one a plugin
    declares), else to a name of a plugin module declared at this path (``dsplug_api_modules``).
    The plugins are looked up on the first miss, never at import."""
    state: dict = {}

    def targets() -> List[types.ModuleType]:
        if "targets" not in state:
            found = _targets(module_name)
            if _registry() is None:
                return found  # plugins still being discovered: look again next time
            state["targets"] = found
        return state["targets"]

    def declared_children() -> frozenset:
        if "children" not in state:
            found = frozenset(_children(module_name))
            if _registry() is None:
                return found
            state["children"] = found
        return state["children"]

    def kernel_children() -> List[str]:
        if "kernel" not in state:
            package = sys.modules.get(module_name)
            state["kernel"] = [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", None) or [])]
        return state["kernel"]

    def __getattr__(attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        if attr in kernel_children():
            return importlib.import_module(f"{module_name}.{attr}")
        try:
            return _lookup(module_name, attr, declared_children(), targets())
        except ApiPathError as exc:  # keep hasattr() usable: a miss is an AttributeError
            raise AttributeError(str(exc)) from exc

    def __dir__() -> List[str]:
        package = sys.modules[module_name]
        names = {n for n in vars(package) if not (n.startswith("__") and n.endswith("__"))}
        names.update(kernel_children())
        names.update(declared_children())
        for target in targets():
            names.update(_public(target))
        return sorted(names)

    return __getattr__, __dir__


def installed() -> bool:
    return any(getattr(f, "dsplug_api_paths", False) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). Cheap: imports nothing."""
    if not installed():
        sys.meta_path.insert(0, ApiPathFinder())
