"""The kernel stays small: its lines by role, with the kernel proper at most 5,000 code lines.

Roles (by path under core/, imported as ``dsplug``):

* comm -- ``core/comm/`` (the collectives layer, its fault handling and hooks), except the
  DeepSpeed-name module;
* native-op service -- ``core/op_builder/`` and ``core/ops/`` (building and loading the C++ ops,
  their Python side every plugin may use);
* testing -- ``core/testing/`` (``dsplug.testing``: contract suites for plugin authors);
* facades -- modules that exist to answer DeepSpeed's import paths (``core/runtime/``,
  ``core/utils/``, ``core/unavailable.py``, ``core/comm/deepspeed_compat.py``);
* kernel proper -- everything else: registry, hook specs, contracts, config, engine, checkpoints, CLI.

A code line is a line holding Python code: blank lines, comments and docstrings are not counted
(the hook specs and contracts are documented argument by argument, as a plugin author needs).
Physical lines are printed too. ``python -m tests.core.test_kernel_size`` prints the table.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from tests.conftest import REPO

CORE = REPO / "core"
KERNEL_PROPER_MAX = 5000
FACADES = ("core/unavailable.py", "core/comm/deepspeed_compat.py")
SKIP_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
               tokenize.ENDMARKER}


def role_of(path: Path) -> str:
    rel = path.relative_to(REPO).as_posix()
    if rel.startswith(("core/runtime/", "core/utils/")) or rel in FACADES:
        return "facades"
    if rel.startswith("core/comm/"):
        return "comm"
    if rel.startswith(("core/op_builder/", "core/ops/")):
        return "native-op service"
    if rel.startswith("core/testing/"):
        return "testing"
    return "kernel proper"


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else ():  # a lambda's body is one expression
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                docstrings.update(range(stmt.lineno, stmt.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP_TOKENS:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines)


def lines_by_role():
    """``{role: (code lines, physical lines, files)}``."""
    table = {}
    for path in sorted(CORE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        code, physical, files = table.get(role_of(path), (0, 0, 0))
        table[role_of(path)] = (code + code_lines(source), physical + len(source.splitlines()), files + 1)
    return table


def test_code_lines_count_code_only():
    source = '"""module doc\n\nmore"""\nimport os  # a comment\n\n# only a comment\ndef f():\n    """doc"""\n    ' \
             'return (1,\n            2)\n'
    assert code_lines(source) == 4  # import, def, and the two lines of the return


def test_the_kernel_proper_stays_within_its_budget():
    table = lines_by_role()
    assert set(table) == {"kernel proper", "comm", "native-op service", "testing", "facades"}
    code = table["kernel proper"][0]
    assert code <= KERNEL_PROPER_MAX, (
        f"the kernel proper has {code} code lines, over its budget of {KERNEL_PROPER_MAX}: move feature logic into "
        "its plugin (docs/writing-plugins.md), or a service into the role it belongs to")


def test_no_forwarder_files_in_the_kernel():
    """DeepSpeed's import paths are served by dsplug.api_paths from what plugins declare, never by a
    two-line module re-exporting a plugin's."""
    forwarders = []
    for path in CORE.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if "dsplug.plugins" in source and code_lines(source) <= 3:
            forwarders.append(path.relative_to(REPO).as_posix())
    assert not forwarders, f"forwarder files in core/: {forwarders}; declare the path with dsplug_api_modules"


if __name__ == "__main__":
    total = [0, 0, 0]
    print(f"{'role':<20}{'code lines':>12}{'physical':>10}{'files':>7}")
    for role, (code, physical, files) in sorted(lines_by_role().items(), key=lambda item: -item[1][0]):
        print(f"{role:<20}{code:>12}{physical:>10}{files:>7}")
        total = [total[0] + code, total[1] + physical, total[2] + files]
    print(f"{'all of core/':<20}{total[0]:>12}{total[1]:>10}{total[2]:>7}")
