"""Which environment variables travel to remote nodes.

Like DeepSpeed's multi-node runner: variables whose names start with one of
:data:`EXPORT_PREFIXES` are copied from the launching shell, ``PYTHONPATH`` gets the working
directory prepended, then ``KEY=VALUE`` lines from ``~/.deepspeed_env`` and ``./.deepspeed_env``
(the file name can be changed with ``DS_ENV_FILE``) are added, later files overriding earlier
ones. Local launches inherit the whole environment and do not need any of this.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Mapping

from .errors import LaunchError

EXPORT_PREFIXES = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW", "DSPLUG", "DS_ACCELERATOR")
ENV_FILE_NAME_VARIABLE = "DS_ENV_FILE"
DEFAULT_ENV_FILE_NAME = ".deepspeed_env"
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_env_key(key: str, where: str) -> str:
    if not _KEY.match(key):
        raise LaunchError(f"{where}: {key!r} is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    return key


def parse_env_text(text: str, source: str) -> Dict[str, str]:
    """``KEY=VALUE`` per line; blank lines and ``#`` comment lines are skipped."""
    result: Dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise LaunchError(f"{source}:{lineno}: cannot read {line!r}; expected KEY=VALUE")
        result[check_env_key(key.strip(), f"{source}:{lineno}")] = value.strip()
    return result


def default_env_files(environ: Mapping[str, str], cwd: str) -> List[str]:
    name = environ.get(ENV_FILE_NAME_VARIABLE) or DEFAULT_ENV_FILE_NAME
    return [os.path.join(os.path.expanduser("~"), name), os.path.join(cwd, name)]


def remote_exports(environ: Mapping[str, str], cwd: str, env_files: Iterable[str]) -> Dict[str, str]:
    """The variables to set on remote nodes, in a stable order."""
    exports = {key: environ[key] for key in sorted(environ) if key.startswith(EXPORT_PREFIXES)}
    exports.pop("PYTHONPATH", None)
    exports["PYTHONPATH"] = cwd + (os.pathsep + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    seen = set()
    for path in env_files:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(path):
            continue
        seen.add(real)
        with open(path, encoding="utf-8") as f:
            exports.update(parse_env_text(f.read(), path))
    return exports
