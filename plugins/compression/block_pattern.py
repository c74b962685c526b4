"""``block_pattern`` values (``"NxM"`` / ``"N:M"``) parsed without torch, so that the config schema
(:mod:`.config`) checks them while ``dsplug config check`` and plugin discovery stay torch-free.
What the patterns mean for a mask: :mod:`.masks`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

_PATTERN_FORMS = "'NxM' (e.g. '4x1': blocks of N rows x M columns) or 'N:M' (e.g. '2:4': N kept of every M inputs)"


@dataclass(frozen=True)
class BlockPattern:
    """A parsed ``block_pattern``: ``kind`` is ``"NxM"`` or ``"N:M"``."""
    kind: str
    n: int
    m: int

    def __str__(self) -> str:
        return f"{self.n}x{self.m}" if self.kind == "NxM" else f"{self.n}:{self.m}"


def parse_block_pattern(text: Union[str, BlockPattern]) -> BlockPattern:
    """Parse ``"NxM"`` / ``"N:M"`` (positive ints; for N:M also N <= M)."""
    if isinstance(text, BlockPattern):
        return text
    bad = ValueError(f"invalid block_pattern {text!r}: expected {_PATTERN_FORMS}")
    if not isinstance(text, str):
        raise bad
    s = text.strip()
    for sep, kind in (("x", "NxM"), ("X", "NxM"), (":", "N:M")):
        if s.count(sep) == 1:
            a, b = (p.strip() for p in s.split(sep))
            if not (a.isdigit() and b.isdigit()):
                raise bad
            n, m = int(a), int(b)
            if n < 1 or m < 1 or (kind == "N:M" and n > m):
                raise bad
            return BlockPattern(kind, n, m)
    raise bad
