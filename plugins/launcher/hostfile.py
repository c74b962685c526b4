"""DeepSpeed-format hostfiles.

One host per line, ``<hostname> slots=<N>``; ``#`` starts a comment (whole line or trailing);
blank lines are ignored. Host names are restricted to ``[A-Za-z0-9._-]`` (starting with a letter
or digit, so a name can never be read as an ssh option) because they end up on ssh command
lines. A host listed twice, a missing or non-positive slot count, or any extra text is an error
naming the file and line.
"""
from __future__ import annotations

import os
import re
from typing import Dict

from .errors import LaunchError

#: Where DeepSpeed looks for a hostfile when none is given (DLTS / Azure ML job layout).
DEFAULT_HOSTFILE = "/job/hostfile"

_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_SLOTS = re.compile(r"slots=(\S*)\Z")
_FORMAT = "expected '<hostname> slots=<N>' with N a positive integer"


class HostfileError(LaunchError):
    """A hostfile that cannot be used; the message starts with ``<file>:<line>:``."""


def is_valid_hostname(name: str) -> bool:
    return bool(_HOSTNAME.match(name))


def validate_hostname(name: str, where: str, error: type = LaunchError) -> str:
    """Return ``name`` if it is a safe host name, else raise ``error`` naming ``where`` it came from."""
    if not is_valid_hostname(name):
        raise error(
            f"{where}: invalid host name {name!r}; host names may contain only letters, digits, "
            "'.', '_' and '-', and must start with a letter or digit"
        )
    return name


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> Dict[str, int]:
    """Parse hostfile ``text`` into ``{host: slots}`` in file order. ``source`` names it in errors."""
    pool: Dict[str, int] = {}
    first_line: Dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        tokens = line.split()
        if len(tokens) != 2:
            raise HostfileError(f"{where}: cannot read {raw.strip()!r}; {_FORMAT}")
        host, slots_text = tokens
        validate_hostname(host, where, HostfileError)
        match = _SLOTS.match(slots_text)
        if match is None:
            raise HostfileError(f"{where}: cannot read {raw.strip()!r}; {_FORMAT}")
        value = match.group(1)
        if not value.isascii() or not value.isdigit() or int(value) < 1:
            raise HostfileError(f"{where}: slots={value!r} for host {host!r} is not a positive integer; {_FORMAT}")
        if host in pool:
            raise HostfileError(
                f"{where}: host {host!r} is listed again (first on line {first_line[host]}); list each host once"
            )
        pool[host] = int(value)
        first_line[host] = lineno
    if not pool:
        raise HostfileError(f"{source}: lists no hosts; {_FORMAT}, one host per line")
    return pool


def read_hostfile(path: str) -> Dict[str, int]:
    """Read and parse the hostfile at ``path``; a missing or unreadable file is a :class:`HostfileError`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise HostfileError(f"hostfile {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"hostfile {path!r} cannot be read: {exc}") from None
    return parse_hostfile_text(text, source=os.fspath(path))
