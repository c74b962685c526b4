"""The kernel is a contract: no plugin imports under core/, no feature names in the engine."""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest

from dsplug.registry import get_registry
from tests.conftest import REPO

CORE = REPO / "core"
ENGINE_FILES = ("engine.py", "engine_checkpoint.py")


def _plugin_imports(tree: ast.AST):
    """Line numbers of imports of dsplug.plugins (statements, and import_module("dsplug.plugins..."))."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [("." * node.level) + (node.module or "")]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            names = [node.args[0].value] if isinstance(node.args[0].value, str) else []
        else:
            continue
        if any(re.match(r"(dsplug\.plugins|\.+plugins)(\.|$)", n) for n in names):
            yield node.lineno


def test_core_never_imports_a_plugin_module():
    offenders = [f"{path.relative_to(CORE)}:{line}" for path in CORE.rglob("*.py")
                 for line in _plugin_imports(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_import_check_has_teeth():
    assert list(_plugin_imports(ast.parse("import dsplug.plugins.zero\nx = importlib.import_module('dsplug.plugins')"
                                          "\nfrom ..plugins import y"))) in ([1, 2, 3], [1, 3, 2])


def _feature_names():
    names = set()
    for provided in get_registry().all():
        spec = provided.spec
        names.update(n for n in spec.names() if len(n) > 1)
        if spec.section:
            names.add(spec.section)
    return names


@pytest.mark.parametrize("filename", ENGINE_FILES)
def test_engine_names_no_feature(filename):
    names = _feature_names()
    assert {"fp16", "bf16", "zero_optimization", "adam", "tensorboard"} <= {n.lower() for n in names}  # has teeth
    text = (CORE / filename).read_text()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string in names:
            found.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and not tok.string.startswith(('"""', "'''")):
            for name in names:
                if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", tok.string, re.IGNORECASE):
                    found.append((tok.start[0], name))
    assert found == [], f"{filename} names features: {found}"
    assert not re.search(r"\.stage\s*(==|!=|>=|<=|>|<|in\b)", text), "the engine compares ZeRO stage numbers"


def test_engine_stays_a_conductor():
    assert len((CORE / "engine.py").read_text().splitlines()) < 400
