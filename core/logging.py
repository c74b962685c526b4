"""The ``dsplug`` logger (INFO to stdout by default, like DeepSpeed's) and rank-0 helpers."""
from __future__ import annotations

import logging
import sys


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (so redirection and capture work)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):
        pass


logger = logging.getLogger("dsplug")
if not logger.handlers:
    _handler = _StdoutHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_rank0(message: str, level: int = logging.INFO) -> None:
    from . import comm

    if comm.get_rank() == 0:
        logger.log(level, message)
