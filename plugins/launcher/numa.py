"""DeepSpeed's ``deepspeed.utils.numa`` core-list parsing: ``parse_range_list("0,2-4,6")`` ->
``[0, 2, 3, 4, 6]``, the syntax of DeepSpeed's ``--bind_core_list``.

Pieces are single cores or inclusive ranges ``a-b``; they must ascend without overlapping (a list
that goes back or repeats a core is a ValueError naming the piece), so a typo cannot silently bind
two ranks to one core. dsplug's launcher has no ``--bind_cores_to_rank`` (core binding) yet; this
is the parser alone.
"""
from __future__ import annotations

from typing import List


def parse_range(piece: str) -> List[int]:
    """``"5"`` -> ``[5]``, ``"2-4"`` -> ``[2, 3, 4]``; ValueError for a descending or malformed range."""
    text = piece.strip()
    low, dash, high = text.partition("-")
    try:
        start = int(low)
        end = int(high) if dash else start
    except ValueError:
        raise ValueError(f"core list piece {piece!r} is not a core number or a range a-b") from None
    if start < 0 or end < start:
        raise ValueError(f"core list piece {piece!r}: a range a-b needs 0 <= a <= b")
    return list(range(start, end + 1))


def parse_range_list(range_str: str) -> List[int]:
    """The cores of a comma-separated list of cores and ranges, ascending and without repeats."""
    cores: List[int] = []
    for piece in str(range_str).split(","):
        values = parse_range(piece)
        if cores and values[0] <= cores[-1]:
            raise ValueError(f"core list {range_str!r}: piece {piece.strip()!r} does not come after core "
                             f"{cores[-1]} (list cores and ranges in ascending order, without overlaps)")
        cores.extend(values)
    return cores


__all__ = ["parse_range", "parse_range_list"]
