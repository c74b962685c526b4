"""Reading a config from a path, a dict, or JSON / HJSON text."""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, Tuple


def load_raw(source) -> Tuple[Dict[str, Any], str]:
    """Return ``(dict, description of the source)`` for a path, a dict or JSON/HJSON text.

    Errors name the file and the line / column at fault.
    """
    if isinstance(source, dict):
        return copy.deepcopy(source), "dict"
    if hasattr(source, "__fspath__"):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise TypeError(f"config must be a path, a dict or JSON text, got {type(source).__name__}")
    text = source.strip()
    if text.startswith("{"):
        return _parse_text(text, "JSON text"), "JSON text"
    path = source
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (and the text is not JSON: it does not start with '{{')")
    with open(path, encoding="utf-8") as f:
        content = f.read()
    return _parse_text(content, path, hjson_ok=path.endswith(".hjson")), path


def _parse_text(text: str, where: str, hjson_ok: bool = True) -> Dict[str, Any]:
    from .schema import ConfigError, Issue

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if not hjson_ok:
            raise ConfigError(Issue("", f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"))
        try:
            import hjson
        except ImportError:
            raise ConfigError(Issue("", f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
                                        "(HJSON is read when the 'hjson' package is installed: pip install dsplug[hjson])")) from None
        try:
            data = hjson.loads(text)
        except Exception as hexc:  # hjson raises its own HjsonDecodeError
            raise ConfigError(Issue("", f"{where} is neither JSON ({exc.msg} at line {exc.lineno} column {exc.colno}) nor HJSON ({hexc})")) from None
        data = json.loads(json.dumps(data))  # OrderedDicts -> plain dicts
    if not isinstance(data, dict):
        raise ConfigError(Issue("", f"{where}: the config must be a JSON object, got {type(data).__name__}"))
    return data
