"""DeepSpeed's ``deepspeed.utils.logging``: ``logger`` and rank-aware helpers.

:data:`logger` is dsplug's own logger (``logging.getLogger("dsplug")``, INFO to stdout), so
``deepspeed.utils.logger.setLevel(...)`` controls what dsplug prints.
"""
from __future__ import annotations

import json
import logging
from typing import Iterable, Optional

from ..logging import logger

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _rank() -> int:
    from .. import comm

    return comm.get_rank()


def _selected(ranks: Optional[Iterable[int]]) -> bool:
    """``ranks``: the ranks that log (None or empty: every rank; -1 in it: every rank)."""
    if not ranks:
        return True
    ranks = list(ranks)
    return -1 in ranks or _rank() in ranks


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ``ranks`` (every rank when None), prefixed with the rank."""
    if _selected(ranks):
        logger.log(level, f"[Rank {_rank()}] {message}")


def print_json_dist(message: dict, ranks: Optional[Iterable[int]] = None, path: Optional[str] = None) -> None:
    """Write ``message`` (plus this rank) as JSON to ``path`` on the given ranks."""
    if _selected(ranks):
        message = {**message, "rank": _rank()}
        if path is None:
            logger.info(json.dumps(message))
            return
        with open(path, "w") as f:
            json.dump(message, f)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at most ``max_log_level_str`` ("info", "warning", ...)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    level = log_levels.get(max_log_level_str.lower())
    if level is None:
        raise ValueError(f"{max_log_level_str} is not one of the levels {', '.join(log_levels)}")
    return get_current_level() <= level


__all__ = ["logger", "log_dist", "print_json_dist", "get_current_level", "should_log_le", "log_levels"]
