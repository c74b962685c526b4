"""The constructor signatures of the installed ``torch.optim`` optimizer classes.

Plugin discovery must stay cheap, and importing torch costs seconds, so the signatures are read
from torch's source with :mod:`ast` (``torch/optim/__init__.py`` names the classes, each class's
``__init__`` gives argument names, annotations and literal defaults). When the source cannot be
read that way (a frozen install, a non-literal default) they come from :mod:`inspect` after
importing torch — the same answer, only slower; tests check that the two readings agree.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import io
import logging
import os
import re
import tokenize
from typing import Any, Dict, List, Optional, Tuple

import attrs

log = logging.getLogger(__name__)


class _Required:
    """Marks an argument without a default."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@attrs.frozen
class Argument:
    name: str
    annotation: Optional[str]  # source text of the annotation, None when absent
    default: Any  # REQUIRED when the argument has no default


@attrs.frozen
class OptimizerSignature:
    name: str  # the class name, as exported by torch.optim
    arguments: Tuple[Argument, ...]  # every constructor argument after ``params``


class UnreadableSource(Exception):
    pass


@functools.lru_cache(maxsize=None)
def optimizer_signatures() -> Dict[str, OptimizerSignature]:
    """class name -> signature, for every optimizer class ``torch.optim`` exports (cached)."""
    try:
        return signatures_from_source()
    except (UnreadableSource, OSError, SyntaxError, ValueError, tokenize.TokenError) as exc:
        log.debug("reading torch.optim signatures from source failed (%s); importing torch", exc)
        return signatures_from_inspect()


# ------------------------------------------------------------------------------- from source
# Parsing whole modules costs ~10 ms each; only the few statements needed are cut out and parsed:
# the imports of torch/optim/__init__.py, each class header, each ``def __init__(...)`` header.


def _optim_dir() -> str:
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise UnreadableSource("torch is not installed as a source package")
    return os.path.join(list(spec.submodule_search_locations)[0], "optim")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


_IMPORT = re.compile(r"^from [\w.]+ import ", re.M)
_TOP_LEVEL = re.compile(r"^[^\s#)]", re.M)  # a line starting a top-level statement
_INIT = re.compile(r"^[ \t]+def __init__\(", re.M)
_CONSTANT = re.compile(r"^([A-Za-z_]\w*)\s*(?::[^=\n]+)?=\s*(.+)$", re.M)


def _statement(text: str, start: int) -> ast.stmt:
    """Parse the statement beginning at ``start``: a simple statement (its brackets may span
    lines), or just the header of a ``class`` / ``def`` (up to its colon, body replaced)."""
    rest = text[start:]
    compound = rest.startswith(("class ", "def "))
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(rest).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif depth == 0 and compound and tok.type == tokenize.OP and tok.string == ":":
            return ast.parse(rest[: _offset(rest, tok.end)] + " pass").body[0]
        elif depth == 0 and not compound and tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            return ast.parse(rest[: _offset(rest, tok.start)]).body[0]
    raise UnreadableSource(f"unterminated statement at {rest[:40]!r}")


def _offset(text: str, position: Tuple[int, int]) -> int:
    """Character offset in ``text`` of a tokenize (row, col) position."""
    row, col = position
    lines = text.split("\n", row - 1)
    return sum(len(line) + 1 for line in lines[: row - 1]) + col


def _exported_classes(init_text: str) -> Dict[str, Tuple[str, str]]:
    """Exported name -> (module path relative to torch.optim, name in that module)."""
    found = {}
    for match in _IMPORT.finditer(init_text):
        node = _statement(init_text, match.start())
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        if node.level == 1:
            relative = node.module
        elif node.level == 0 and node.module.startswith("torch.optim."):
            relative = node.module[len("torch.optim."):]
        else:
            continue
        for alias in node.names:
            public = alias.asname or alias.name
            if public[:1].isupper() and public != "Optimizer":
                found[public] = (relative, alias.name)
    return found


def _module_constants(text: str) -> Dict[str, Any]:
    """Top-level single-line ``NAME = <literal>`` assignments (Muon's defaults refer to them)."""
    constants = {}
    for name, value in _CONSTANT.findall(text):
        try:
            constants[name] = ast.literal_eval(value.strip())
        except (ValueError, TypeError, SyntaxError):
            pass
    return constants


class _Substitute(ast.NodeTransformer):
    def __init__(self, constants: Dict[str, Any]):
        self.constants = constants

    def visit_Name(self, node: ast.Name):
        if node.id in self.constants:
            return ast.copy_location(ast.Constant(self.constants[node.id]), node)
        return node


def _literal(node: ast.expr, text: str):
    if isinstance(node, ast.Name) and node.id == "required":  # torch's old "no default" sentinel
        return REQUIRED
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        pass
    try:
        return ast.literal_eval(_Substitute(_module_constants(text)).visit(node))
    except (ValueError, TypeError, SyntaxError) as exc:
        raise UnreadableSource(f"non-literal default {ast.unparse(node)!r}") from exc


def _arguments(init_fn: ast.FunctionDef, text: str, where: str) -> Tuple[Argument, ...]:
    spec = init_fn.args
    positional = list(spec.posonlyargs) + list(spec.args)
    if len(positional) < 2 or positional[1].arg != "params":
        raise UnreadableSource(f"{where}: __init__ does not start with (self, params)")
    defaults: List[Any] = [REQUIRED] * (len(positional) - len(spec.defaults))
    defaults += [_literal(d, text) for d in spec.defaults]
    pairs = list(zip(positional, defaults))[2:]
    pairs += [(a, REQUIRED if d is None else _literal(d, text)) for a, d in zip(spec.kwonlyargs, spec.kw_defaults)]
    return tuple(
        Argument(a.arg, ast.unparse(a.annotation) if a.annotation is not None else None, default)
        for a, default in pairs
    )


@attrs.frozen
class _ClassSource:
    bases: Tuple[str, ...]  # last dotted component of each base
    init: Optional[Tuple[Argument, ...]]  # None: no __init__ of its own


def _class_source(text: str, name: str, where: str) -> _ClassSource:
    match = re.search(rf"^class {re.escape(name)}\b", text, re.M)
    if match is None:
        raise UnreadableSource(f"class {name} not found in {where}")
    cls = _statement(text, match.start())
    bases = tuple(ast.unparse(b).split(".")[-1] for b in cls.bases)
    body_start = text.index(":", match.end())
    next_top = _TOP_LEVEL.search(text, text.index("\n", body_start) + 1)
    body_end = next_top.start() if next_top else len(text)
    init = _INIT.search(text, body_start, body_end)
    if init is None:
        return _ClassSource(bases, None)
    fn = _statement(text, init.end() - len("def __init__("))
    return _ClassSource(bases, _arguments(fn, text, f"{where}:{name}"))


def signatures_from_source(optim_dir: Optional[str] = None) -> Dict[str, OptimizerSignature]:
    optim_dir = optim_dir or _optim_dir()
    texts: Dict[str, str] = {}
    classes: Dict[str, _ClassSource] = {}
    exported = _exported_classes(_read(os.path.join(optim_dir, "__init__.py")))
    for public, (relative, original) in exported.items():
        path = os.path.join(optim_dir, *relative.split(".")) + ".py"
        if path not in texts:
            texts[path] = _read(path)
        classes[public] = _class_source(texts[path], original, path)
    by_original = {original: public for public, (_, original) in exported.items()}

    def resolve(public: str, seen=()) -> Optional[Tuple[Argument, ...]]:
        """The constructor arguments if ``public`` derives from Optimizer (else None)."""
        source = classes[public]
        for base in source.bases:
            if base == "Optimizer":
                parent_init: Optional[Tuple[Argument, ...]] = ()
            elif base in by_original and by_original[base] not in seen:
                parent_init = resolve(by_original[base], seen + (public,))
            else:
                continue
            if parent_init is not None:
                if source.init is not None:
                    return source.init
                if base == "Optimizer":
                    raise UnreadableSource(f"{public} has no __init__ of its own")
                return parent_init
        return None

    out = {}
    for public in exported:
        arguments = resolve(public)
        if arguments is not None:
            out[public] = OptimizerSignature(public, arguments)
    if not out:
        raise UnreadableSource(f"no optimizer classes found under {optim_dir}")
    return out


# ------------------------------------------------------------------------------ from inspect
def _annotation_text(annotation) -> Optional[str]:
    import inspect

    if annotation is inspect.Parameter.empty:
        return None
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def signatures_from_inspect() -> Dict[str, OptimizerSignature]:
    import importlib
    import inspect

    import torch.optim

    base = importlib.import_module("torch.optim.optimizer")
    no_default = (inspect.Parameter.empty, getattr(base, "required", inspect.Parameter.empty))
    out = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, params
        out[name] = OptimizerSignature(
            name,
            tuple(
                Argument(
                    p.name,
                    _annotation_text(p.annotation),
                    REQUIRED if any(p.default is d for d in no_default) else p.default,
                )
                for p in parameters
                if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            ),
        )
    return out
