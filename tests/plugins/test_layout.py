"""Every plugin folder follows one layout (docs/writing-plugins.md, "Layout of a plugin").

* each ``dsplug`` entry point of pyproject.toml targets a module named ``plugin``
  (``dsplug.plugins.<pkg>.plugin``, or ``dsplug.plugins.<pkg>.<sub>.plugin`` for a sub-plugin such
  as a ZeRO stage), which holds the hooks only: no class, and every public function is a hook
  implementation (private helpers allowed); no other module of plugins/ has module-level hooks;
* no two classes share a name across core/ and plugins/, so a name says which class it is;
* every plugin with an entry point has its tests in tests/plugins/<pkg>/.
"""
from __future__ import annotations

import ast
import collections
import importlib
import tomllib
from pathlib import Path
from typing import Dict, List

import pytest

from dsplug.hookspecs import PROJECT
from tests.conftest import REPO

PLUGINS = REPO / "plugins"
KERNEL = REPO / "core"
#: the attribute pluggy's ``HookimplMarker(PROJECT)`` (``@dsplug.hookimpl``) sets on a function
HOOKIMPL_MARK = f"{PROJECT}_impl"


def entry_points() -> Dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"]["dsplug"])


def file_of(module: str) -> Path:
    """plugins/... file of a ``dsplug.plugins.*`` module (``dsplug.plugins`` is the plugins/ folder)."""
    return PLUGINS.joinpath(*module.split(".")[2:]).with_suffix(".py")


def plugin_modules() -> List[str]:
    return sorted({value.split(":")[0] for value in entry_points().values()})


def test_every_entry_point_targets_a_plugin_module():
    wrong = []
    for name, value in entry_points().items():
        module, _, attr = value.partition(":")
        if attr or not module.startswith("dsplug.plugins.") or module.rsplit(".", 1)[-1] != "plugin":
            wrong.append(f"{name} = {value!r}")
        elif not file_of(module).is_file():
            wrong.append(f"{name} = {value!r} (no file {file_of(module).relative_to(REPO)})")
    assert not wrong, (
        "these dsplug entry points do not target an existing module named `plugin`:\n  " + "\n  ".join(wrong) +
        "\nMove the plugin's hooks into plugins/<pkg>/plugin.py (plugins/<pkg>/<sub>/plugin.py for a sub-plugin), "
        "point the entry point at 'dsplug.plugins.<pkg>.plugin' (no ':attribute'), then reinstall: "
        "pip install --no-deps --no-build-isolation -e .")


@pytest.mark.parametrize("module", plugin_modules())
def test_plugin_module_holds_hooks_only(module):
    path = file_of(module)
    tree = ast.parse(path.read_text(), str(path))
    classes = [f"{node.name} (line {node.lineno})" for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    assert not classes, (
        f"{path.relative_to(REPO)} defines classes {classes}: an entry-point module holds hooks only. Move each "
        "class to a feature module of the plugin (observer.py, config.py for a config schema, ...) and import it "
        "(inside the hook when that module imports torch).")
    loaded = importlib.import_module(module)
    public = [node.name for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")]
    not_hooks = [name for name in public if not hasattr(getattr(loaded, name), HOOKIMPL_MARK)]
    assert not not_hooks, (
        f"{path.relative_to(REPO)} defines public functions that are not hook implementations: {not_hooks}. "
        "Move feature logic (factories, rules, CLI commands, DeepSpeed config attributes) to a feature module "
        "of the plugin and reference it from the hook; a small glue helper may stay here with a leading '_'. "
        "A hook needs @dsplug.hookimpl.")
    assert any(hasattr(getattr(loaded, name), HOOKIMPL_MARK) for name in public), (
        f"{path.relative_to(REPO)} implements no hook: give it the plugin's @hookimpl functions.")


def test_hooks_live_in_plugin_modules():
    """Module-level hook implementations outside ``plugin.py`` would make a second entry point."""
    found = []
    for path in sorted(PLUGINS.rglob("*.py")):
        if path.name == "plugin.py":
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    "hookimpl" in ast.unparse(d) for d in node.decorator_list):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not found, (
        "module-level hook implementations outside a plugin.py:\n  " + "\n  ".join(found) +
        "\nMove each into the plugin's plugin.py (it may call a plain function of this module). Hooks of "
        "observer objects (methods) are fine anywhere.")


def test_no_two_classes_share_a_name():
    where = collections.defaultdict(list)
    for top in (KERNEL, PLUGINS):
        for path in sorted(top.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(REPO)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, (
        "classes sharing a name across core/ and plugins/:\n  " +
        "\n  ".join(f"{name}: {', '.join(places)}" for name, places in sorted(shared.items())) +
        "\nRename all but one to a name that says what it is (update code, tests and docs). Keep a DeepSpeed "
        "class name that users import from a DeepSpeed path; rename the other class.")


def test_every_plugin_has_its_tests():
    packages = sorted({module.split(".")[2] for module in plugin_modules()})
    missing = [pkg for pkg in packages if not any((REPO / "tests" / "plugins" / pkg).rglob("test_*.py"))]
    assert not missing, (
        f"plugins without tests in tests/plugins/<pkg>/: {missing}. Add tests/plugins/<pkg>/__init__.py (empty) "
        "and test_*.py files there that exercise the plugin's behaviour (tests mirror plugins/).")
