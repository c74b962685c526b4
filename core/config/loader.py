"""Reading a config from a path, a dict, or JSON / HJSON text (``str`` or UTF-8 ``bytes``).

Whatever the input, a bad one ends in a one-line :class:`~dsplug.config.schema.ConfigError`
naming the file (or "JSON text" / "dict"), never in a traceback from the parser:

* JSON syntax errors name the line and column; a key given twice in one object is an error
  naming the key's JSON path and both lines (JSON's "last one wins" would silently drop a value;
  HJSON too, with the lines where they can be found);
* a file that is not UTF-8 text names the offending byte's line and column (a UTF-8 byte-order
  mark is accepted);
* nesting deeper than :data:`MAX_DEPTH` levels is refused before the parser recurses into it;
* a dict must have string keys (JSON's) and no cycles.

Text that is not JSON is read as HJSON (comments, unquoted keys), whatever the file's name, as
DeepSpeed reads its configs: its documented configs carry comments. A missing file is a ``FileNotFoundError``; an argument that is no config at all (a number, a
list object) a ``TypeError``.
"""
from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

#: Deepest nesting of objects / arrays accepted. DeepSpeed's configs nest at most ~6 levels
#: (compression_training ... different_groups ... params); 100 leaves room for any plugin while
#: keeping every recursive step (parser, deepcopy, schema parsing) far below Python's recursion limit.
MAX_DEPTH = 100


def load_raw(source) -> Tuple[Dict[str, Any], str]:
    """Return ``(dict, description of the source)`` for a path, a dict or JSON/HJSON text.

    Errors name the file and the line / column at fault.
    """
    if isinstance(source, Mapping):
        if not isinstance(source, dict):
            source = dict(source)  # any mapping (a DsplugConfig: its resolved data)
        _check_structure(source, "dict")
        try:
            data = copy.deepcopy(source)
        except Exception as exc:  # an uncopyable value: not JSON data
            raise _error(f"dict: cannot copy the config ({type(exc).__name__}: {exc}); give JSON data: objects, "
                         "lists, strings, numbers, booleans and null") from None
        return data, "dict"
    if isinstance(source, (bytes, bytearray)):
        source = _decode(bytes(source), "config bytes")
    elif hasattr(source, "__fspath__"):
        source = os.fspath(source)
        if isinstance(source, bytes):
            source = os.fsdecode(source)
    if not isinstance(source, str):
        raise TypeError(f"config must be a path, a dict or JSON text, got {type(source).__name__}")
    text = source.lstrip("\ufeff").strip()
    if not text:
        raise _error("the config is empty: give a path, a dict or JSON text ('{...}')")
    if text.startswith(("{", "[")):
        return _parse_text(text, "JSON text"), "JSON text"
    path = source
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (and the text is not JSON: it does not start with '{{')")
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as exc:  # a directory, no permission, ...
        raise _error(f"cannot read config file {path}: {exc.strerror or exc}") from None
    return _parse_text(_decode(content, path), path, json_first=not path.endswith(".hjson")), path


# ------------------------------------------------------------------------------------- helpers
def _error(message: str, path: str = ""):
    from .schema import ConfigError, Issue

    return ConfigError(Issue(path, message))


def _line_col(text, pos: int) -> Tuple[int, int]:
    newline = "\n" if isinstance(text, str) else b"\n"
    line = text.count(newline, 0, pos) + 1
    return line, pos - (text.rfind(newline, 0, pos) + 1) + 1


def _decode(content: bytes, where: str) -> str:
    """UTF-8 text (a byte-order mark is dropped), or a ConfigError naming the first bad byte."""
    if content.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise _error(f"{where} is not UTF-8 text: it starts with a UTF-16 byte-order mark; save it as UTF-8")
    try:
        return content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, col = _line_col(content, exc.start)
        raise _error(f"{where} is not UTF-8 text: byte 0x{content[exc.start]:02x} at line {line} column {col} "
                     f"cannot be decoded ({exc.reason}); save the file as UTF-8") from None


def _too_deep(where: str, path: str, line: Optional[int] = None) -> Exception:
    at = f" at line {line}" if line is not None else ""
    if len(path) > 60:
        path = path[:57] + "..."
    under = f" (under {path})" if path else ""
    return _error(f"{where} is nested more than {MAX_DEPTH} levels deep{at}{under}; a DeepSpeed config needs "
                  "fewer than 10")


def _child(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _check_structure(data, where: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH (cycles included) and non-string keys, walking
    ``data`` without recursion; a container shared by several parents is walked again only when
    reached at a greater depth, so the walk stays linear in practice and always ends."""
    deepest_seen: Dict[int, int] = {}
    stack: List[Tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, Mapping):
            items = list(value.items())
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(where, path)
        if deepest_seen.get(id(value), 0) >= depth:
            continue
        deepest_seen[id(value)] = depth
        is_mapping = isinstance(value, Mapping)
        for key, child in reversed(items):
            if is_mapping and not isinstance(key, str):
                raise _error(f"{where}: key {key!r} ({type(key).__name__}) is not a string; JSON object keys are "
                             "strings", path)
            if isinstance(child, (Mapping, list, tuple)):
                stack.append((child, _child(path, key), depth + 1))


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]')


class _Frame:
    __slots__ = ("is_object", "path", "keys", "key", "index")

    def __init__(self, is_object: bool, path: str):
        self.is_object, self.path = is_object, path
        self.keys: Dict[str, int] = {}
        self.key: Optional[str] = None
        self.index = 0

    def child_path(self) -> str:
        if self.is_object:
            return _child(self.path, self.key if self.key is not None else "?")
        return _child(self.path, self.index)


def _scan(text: str, where: str) -> List[Tuple[str, int, int]]:
    """One pass over JSON text, without recursion: refuse nesting deeper than MAX_DEPTH (before
    the recursive parser sees it) and return the keys given twice in one object as
    ``(json path, first position, second position)``. Exact for valid JSON; for text json
    rejects (HJSON) it is only used for the depth, which is checked again after parsing."""
    stack: List[_Frame] = []
    duplicates: List[Tuple[str, int, int]] = []
    previous = None  # the string token just before, a key if a ':' follows
    for match in _TOKEN.finditer(text):
        token = match.group()
        kind = token[0]
        if kind == '"':
            previous = match
            continue
        if kind in "{[":
            if len(stack) >= MAX_DEPTH:
                raise _too_deep(where, stack[-1].child_path(), _line_col(text, match.start())[0])
            stack.append(_Frame(kind == "{", stack[-1].child_path() if stack else ""))
        elif kind in "}]":
            if stack:
                stack.pop()
        elif kind == ":":
            if previous is not None and stack and stack[-1].is_object:
                try:
                    key = json.loads(previous.group())
                except ValueError:
                    key = previous.group()[1:-1]
                frame = stack[-1]
                if key in frame.keys:
                    duplicates.append((_child(frame.path, key), frame.keys[key], previous.start()))
                else:
                    frame.keys[key] = previous.start()
                frame.key = key
        elif kind == "," and stack and not stack[-1].is_object:
            stack[-1].index += 1
        previous = None
    return duplicates


def _duplicate_error(where: str, found: List[Tuple[str, Optional[int], Optional[int]]], text: str):
    from .schema import ConfigError, Issue

    issues = []
    for path, first, second in found:
        if first is not None and second is not None:
            lines = f" (line {_line_col(text, first)[0]} and line {_line_col(text, second)[0]})"
        else:
            lines = ""
        issues.append(Issue(path, f"key given twice in {where}{lines}; JSON would silently keep only the last "
                                  "value: keep one"))
    return ConfigError(issues)


def _hjson_duplicates(text: str, keys: List[str]) -> List[Tuple[str, Optional[int], Optional[int]]]:
    """Best-effort lines of HJSON keys given twice: where the key opens a line (two such lines)."""
    found = []
    for key in keys:
        spelled = re.escape(key)
        pattern = re.compile(rf"""^[ \t]*(?:"{spelled}"|'{spelled}'|{spelled})[ \t]*:""", re.M)
        hits = [m.start() for m in pattern.finditer(text)]
        found.append((key, hits[0], hits[1]) if len(hits) == 2 else (key, None, None))
    return found


def _parse_text(text: str, where: str, json_first: bool = False) -> Dict[str, Any]:
    """``json_first``: when the text is neither JSON nor HJSON, the JSON error leads the message (a
    ``.json`` file); otherwise the message says both."""
    from .schema import ConfigError, Issue

    duplicates = _scan(text, where)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        data = _parse_hjson(text, where, exc, json_first)
    except RecursionError:
        raise _too_deep(where, "") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise _error(f"{where} is not valid JSON: {exc}") from None
    else:
        if duplicates:
            raise _duplicate_error(where, duplicates, text)
    if not isinstance(data, dict):
        raise ConfigError(Issue("", f"{where}: the config must be a JSON object, got {type(data).__name__}"))
    return data


def _parse_hjson(text: str, where: str, exc: json.JSONDecodeError, json_first: bool = False) -> Dict[str, Any]:
    from .schema import ConfigError, Issue

    try:
        import hjson
    except ImportError:  # a dependency of dsplug: only a broken environment lacks it
        raise ConfigError(Issue("", f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
                                    "(and HJSON cannot be tried: the 'hjson' package, a dependency of dsplug, "
                                    "is missing: pip install hjson)")) from None
    twice: List[str] = []

    def pairs(items):
        seen = set()
        for key, _ in items:
            if key in seen and key not in twice:
                twice.append(key)
            seen.add(key)
        return dict(items)

    try:
        data = hjson.loads(text, object_pairs_hook=pairs)
    except RecursionError:
        raise _too_deep(where, "") from None
    except Exception as hexc:  # hjson raises its own HjsonDecodeError
        if json_first:
            raise ConfigError(Issue("", f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column "
                                        f"{exc.colno} (nor HJSON: {hexc})")) from None
        raise ConfigError(Issue("", f"{where} is neither JSON ({exc.msg} at line {exc.lineno} column {exc.colno}) "
                                    f"nor HJSON ({hexc})")) from None
    if twice:
        raise _duplicate_error(where, _hjson_duplicates(text, twice), text)
    _check_structure(data, where)
    try:
        return json.loads(json.dumps(data))  # OrderedDicts -> plain dicts
    except (TypeError, ValueError) as jexc:
        raise ConfigError(Issue("", f"{where}: HJSON value that JSON cannot hold ({jexc})")) from None
