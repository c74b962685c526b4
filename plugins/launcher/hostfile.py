"""DeepSpeed-format hostfiles.

One host per line, ``<hostname> slots=<N>``; ``#`` starts a comment (whole line or trailing);
blank lines are ignored. Host names are restricted to ``[A-Za-z0-9._-]`` (starting with a letter
or digit, so a name can never be read as an ssh option) because they end up on ssh command
lines. A host listed twice, a missing, non-positive or absurd slot count (above
:data:`MAX_SLOTS`), a host name longer than :data:`MAX_HOSTNAME_LENGTH`, or any extra text is an
error naming the file, the line and the value.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Optional

from .errors import LaunchError

#: Where DeepSpeed looks for a hostfile when none is given (DLTS / Azure ML job layout).
DEFAULT_HOSTFILE = "/job/hostfile"

#: The most slots (processes) one host may run: far above any real node (GPUs, or CPU cores with
#: ``--num_procs``), low enough that a typo like ``slots=40000000`` is an error, not an attempt
#: to start millions of processes.
MAX_SLOTS = 4096
#: The longest host name accepted (a DNS name has at most 253 characters).
MAX_HOSTNAME_LENGTH = 253

_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_SLOTS = re.compile(r"slots=(\S*)\Z")
_FORMAT = f"expected '<hostname> slots=<N>' with N a positive integer (at most {MAX_SLOTS})"


class HostfileError(LaunchError):
    """A hostfile that cannot be used; the message starts with ``<file>:<line>:``."""


def is_valid_hostname(name: str) -> bool:
    return len(name) <= MAX_HOSTNAME_LENGTH and bool(_HOSTNAME.match(name))


def _shown(text: str, limit: int = 40) -> str:
    """``repr`` of ``text``, shortened in the middle when it is long (a value in an error message)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit // 2]!r}...{text[-(limit // 2):]!r} ({len(text)} characters)"


def validate_hostname(name: str, where: str, error: type = LaunchError) -> str:
    """Return ``name`` if it is a safe host name, else raise ``error`` naming ``where`` it came from."""
    if len(name) > MAX_HOSTNAME_LENGTH:
        raise error(f"{where}: host name {_shown(name)} is longer than {MAX_HOSTNAME_LENGTH} characters")
    if not is_valid_hostname(name):
        raise error(
            f"{where}: invalid host name {name!r}; host names may contain only letters, digits, "
            "'.', '_' and '-', and must start with a letter or digit"
        )
    return name


def parse_slot_count(text: str) -> Optional[int]:
    """The positive integer ``text`` spells in ASCII digits (any size; the caller checks the bound), or None.

    Huge values are compared by their digit count, never converted blindly (``int()`` refuses
    strings over 4300 digits, and a 10**30 slot count must not reach ``range``)."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    digits = text.lstrip("0")
    if not digits:
        return None  # zero
    if len(digits) > len(str(MAX_SLOTS)):
        return MAX_SLOTS + 1  # certainly above the bound; the exact value does not matter
    return int(digits)


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
        slots = parse_slot_count(value)
        if slots is None:
            raise HostfileError(f"{where}: slots={_shown(value)} for host {host!r} is not a positive integer; "
                                f"{_FORMAT}")
        if slots > MAX_SLOTS:
            raise HostfileError(f"{where}: slots={_shown(value)} for host {host!r} is more than a host can run "
                                f"(at most {MAX_SLOTS}); {_FORMAT}")
        if host in pool:
            raise HostfileError(
                f"{where}: host {host!r} is listed again (first on line {first_line[host]}); list each host once"
            )
        pool[host] = slots
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
