"""No plugin imports another plugin's modules.

Each folder of ``plugins/`` is one plugin. Every import in it is resolved: module-level and inside
functions, relative ones, ``importlib.import_module`` / ``__import__`` of a string (or of an
f-string's constant prefix), and imports of a DeepSpeed path that a plugin declares through
``dsplug_api_modules`` (``dsplug.zero``, ``dsplug.checkpointing`` ...): such a path reaches the
declaring plugin's module, unless the imported name is the kernel's own (``DeepSpeedCPUAdam``
from ``dsplug.ops.adam`` is; ``FusedAdam`` from there is the optimizers plugin's). What plugins
share is a kernel service or a service hook (docs/writing-plugins.md, "Using another plugin").
"""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import pytest

from tests.conftest import REPO

PLUGINS = REPO / "plugins"
KERNEL = REPO / "core"


def plugin_of(module: str) -> Optional[str]:
    """The plugin (folder of plugins/) a dotted module belongs to, or None (the kernel, or not dsplug)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["dsplug", "plugins"] and len(parts) > 2 else None


def module_of(path: Path) -> Tuple[str, bool]:
    """``(dotted name, is a package)`` of a file under plugins/."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    package = parts[-1] == "__init__"
    if package:
        parts = parts[:-1]
    return ".".join(["dsplug"] + parts), package


# ----------------------------------------------------------------------------- what a file imports
def _string_prefix(node: ast.expr) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).rstrip(".") or None  # f"dsplug.plugins.zero.{name}"
    return None


def imports(source: str, module: str, package: bool) -> Iterator[Tuple[int, str, Tuple[str, ...]]]:
    """``(line, module, names)`` for every import in ``source`` (names: those of ``from m import a, b``)."""
    base = module.split(".") if package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target, tuple(a.name for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                text = _string_prefix(node.args[0])
                if text and not text.startswith("."):
                    yield node.lineno, text, ()


# ----------------------------------------------------------------------------- whose module it is
class Resolver:
    """Which plugins an import reaches, given the DeepSpeed paths plugins declare (path -> target)."""

    def __init__(self, api: Dict[str, str]):
        self.api = api

    def providers(self, module: str, names: Sequence[str]) -> Set[str]:
        found = set()
        direct = plugin_of(module)
        if direct:
            return {direct}
        for name in names:  # ``from dsplug.plugins import zero`` / ``from dsplug import zero``
            sub = f"{module}.{name}"
            if plugin_of(sub):
                found.add(plugin_of(sub))
            elif sub in self.api:
                found.add(self._target_plugin(sub))
        prefix = self._api_prefix(module)
        if prefix is None:
            return found
        if module != prefix:  # a module below a declared path: the kernel's when it has the file
            if not self._kernel_file(module):
                found.add(self._target_plugin(prefix))
            return found
        if not names:  # ``import dsplug.zero``: the whole forwarded module
            found.add(self._target_plugin(prefix))
        for name in names:
            if f"{module}.{name}" not in self.api:
                owner = self._defining_plugin(module, name)
                if owner:
                    found.add(owner)
        return found

    def _api_prefix(self, module: str) -> Optional[str]:
        parts = module.split(".")
        for end in range(len(parts), 1, -1):
            if ".".join(parts[:end]) in self.api:
                return ".".join(parts[:end])
        return None

    def _target_plugin(self, path: str) -> str:
        target = self.api[path]
        return plugin_of(target) or target.split(".")[0]

    @staticmethod
    def _kernel_file(module: str) -> bool:
        rest = module.split(".")[1:]
        return bool(rest) and (KERNEL.joinpath(*rest).with_suffix(".py").is_file()
                               or KERNEL.joinpath(*rest, "__init__.py").is_file())

    def _defining_plugin(self, module: str, name: str) -> Optional[str]:
        """The plugin that defines ``name`` as served at ``module``, None for a kernel name."""
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return self._target_plugin(module)
        origin = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if origin is None:  # a constant: whoever the path forwards to
            return self._target_plugin(module)
        return plugin_of(origin)


class CrossImport(NamedTuple):
    where: str  # file:line
    importer: str
    imported: str
    provider: str

    def __str__(self) -> str:
        return f"{self.where}: plugin {self.importer!r} imports {self.imported}, the {self.provider!r} plugin's"


def cross_imports(resolver: Resolver, path: Path, source: Optional[str] = None) -> List[CrossImport]:
    """Every import in ``path`` (or ``source``, read as that file) of another plugin's modules."""
    module, package = module_of(path)
    me = plugin_of(module)
    found = []
    for line, target, names in imports(source if source is not None else path.read_text(), module, package):
        for other in sorted(resolver.providers(target, names) - {me}):
            what = f"{target} ({', '.join(names)})" if names else target
            found.append(CrossImport(f"{path.relative_to(REPO)}:{line}", me, what, other))
    return found


@pytest.fixture(scope="module")
def resolver():
    from dsplug.registry import Registry

    api = {path: entries[0][0].target for path, entries in Registry(blocked=()).api_paths().items()}
    assert "dsplug.zero" in api and "dsplug.ops.adam" in api  # the built-ins' declarations were read
    return Resolver(api)


# ----------------------------------------------------------------------------- the rule
#: (importer, provider) pairs another change of issue 22 removes, and why. Each must still occur
#: (the test fails once it is gone, so the entry is deleted with it); nothing else is allowed.
PENDING: dict = {}


def test_no_plugin_imports_another_plugins_modules(resolver):
    files = sorted(PLUGINS.rglob("*.py"))
    assert len({module_of(f)[0].split(".")[2] for f in files if f.parent != PLUGINS}) >= 20
    problems = [p for f in files if f.parent != PLUGINS for p in cross_imports(resolver, f)]
    unexpected = [str(p) for p in problems if (p.importer, p.provider) not in PENDING]
    assert not unexpected, "plugins import each other's modules (use a kernel service or a service hook, " \
                           "docs/writing-plugins.md):\n" + "\n".join(unexpected)
    gone = sorted(set(PENDING) - {(p.importer, p.provider) for p in problems})
    assert not gone, f"remove {gone} from PENDING: those imports are gone"


# ----------------------------------------------------------------------------- the detector itself
ONEBIT = PLUGINS / "onebit" / "example.py"


@pytest.mark.parametrize("source, provider", [
    ("from dsplug.plugins.optimizers.common import options_of\n", "optimizers"),
    ("import dsplug.plugins.launcher.plan as plan\n", "launcher"),
    ("from dsplug.plugins import zero\n", "zero"),
    ("def f():\n    if True:\n        from dsplug.plugins.optimizers import adam\n", "optimizers"),
    ("from ..optimizers import adam_optimizer\n", "optimizers"),
    ("from .. import compression\n", "compression"),
    ("import importlib\nop = importlib.import_module('dsplug.plugins.compression.masks')\n", "compression"),
    ("from importlib import import_module\nm = import_module(f'dsplug.plugins.pipe.{name}')\n", "pipe"),
    ("mod = __import__('dsplug.plugins.moe.layer')\n", "moe"),
    ("def g():\n    from dsplug.zero import GatheredParameters\n", "zero"),
    ("import dsplug.checkpointing\n", "activation_checkpointing"),
    ("from dsplug import checkpointing\n", "activation_checkpointing"),
    ("from dsplug.ops.adam import FusedAdam\n", "optimizers"),
    ("from dsplug.runtime.lr_schedules import add_tuning_arguments\n", "schedulers"),
])
def test_the_detector_finds_each_kind_of_import(resolver, source, provider):
    found = cross_imports(resolver, ONEBIT, source)
    assert [(p.importer, p.provider) for p in found] == [("onebit", provider)], found


@pytest.mark.parametrize("source", [
    "from . import common\nfrom .adam import OnebitAdam\n",
    "from dsplug.plugins.onebit import common\nimport dsplug.plugins.onebit.lamb\n",
    "from dsplug.ops.multi_tensor import adam_buckets\nfrom dsplug.config.params import options_of\n",
    "from dsplug.ops.adam import DeepSpeedCPUAdam\nfrom dsplug.ops.adam.cpu_adam import native_cpu_adam_fits\n",
    "from dsplug.ops import quantize\nfrom dsplug import comm, hookimpl\nimport torch\n",
    "from dsplug.registry import get_registry\nget_registry().pm.hook.dsplug_flops_counter(module=m, accelerator=None)\n",
    "import importlib\nm = importlib.import_module(f'{__name__}.adam')\n",
])
def test_the_detector_allows_own_modules_the_kernel_and_service_hooks(resolver, source):
    assert cross_imports(resolver, ONEBIT, source) == []
