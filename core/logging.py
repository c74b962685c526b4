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


#: the engine's ``steps_per_print`` line (``[dsplug] step=..., lr=[...], loss=...``), a child of the
#: ``dsplug`` logger (same handler, same output): an application that shows its own progress, like
#: ``dsplug train``, silences it alone with ``step_logger.setLevel(logging.WARNING)``.
step_logger = logging.getLogger("dsplug.steps")


def log_rank0(message: str, level: int = logging.INFO, log: logging.Logger = logger) -> None:
    from . import comm

    if comm.get_rank() == 0:
        log.log(level, message)
