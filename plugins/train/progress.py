"""A small progress display: one line redrawn in place on a terminal, plain lines otherwise.

Each update shows the step, the loss, the learning rate, throughput (tokens/s over the steps
since the previous update) and the time left. On a terminal the line is redrawn at most every
:data:`REDRAW_S` seconds; the ``dsplug`` logger's messages (warnings, skipped steps) are printed
above it, because a filter on that logger clears the line first. Elsewhere (a file, a pipe, CI) a
line is printed every ``every`` steps and at the last step. While the bar is open the engine's own
``steps_per_print`` line (``dsplug.steps`` logger) is silenced: it would repeat the same step, loss
and learning rate, so each interval gets one line.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Optional, TextIO

from dsplug.logging import step_logger

REDRAW_S = 0.2


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_rate(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


class ProgressBar:
    """Progress of optimizer steps ``first..last``; ``update()`` after each step, ``close()`` at the end."""

    def __init__(self, first: int, last: int, tokens_per_step: int, every: int = 10,
                 stream: Optional[TextIO] = None, interactive: Optional[bool] = None, width: int = 24):
        self.first, self.last = first, last
        self.tokens_per_step = tokens_per_step
        self.every = max(1, every)
        self._stream = stream
        self.interactive = interactive if interactive is not None else _isatty(self.stream)
        self.width = width
        self._start = self._mark_time = time.perf_counter()
        self._mark_step = first - 1
        self._rate = 0.0  # tokens/s over the last measured window
        self._last_draw = 0.0
        self._line_shown = False
        self._log_filter = None
        self._step_level = step_logger.level
        step_logger.setLevel(logging.WARNING)
        if self.interactive:
            self._log_filter = _ClearLineFilter(self)
            logging.getLogger("dsplug").addFilter(self._log_filter)

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def update(self, step: int, loss: float, lr: float, loss_scale: Optional[float] = None) -> None:
        now = time.perf_counter()
        due = step == self.last or (now - self._last_draw >= REDRAW_S if self.interactive else
                                    (step - self.first + 1) % self.every == 0)
        if not due:
            return
        if step > self._mark_step and now > self._mark_time:
            self._rate = (step - self._mark_step) * self.tokens_per_step / (now - self._mark_time)
            self._mark_step, self._mark_time = step, now
        done = step - self.first + 1
        total = self.last - self.first + 1
        elapsed = now - self._start
        eta = elapsed / done * (total - done) if done else 0.0
        scale = f"  loss scale {loss_scale:g}" if loss_scale is not None else ""
        text = (f"step {step}/{self.last}  loss {loss:.4f}  lr {lr:.2e}{scale}  {format_rate(self._rate)} tok/s  "
                f"{format_duration(elapsed)} elapsed, {format_duration(eta)} left")
        if self.interactive:
            filled = int(self.width * done / total) if total else self.width
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r\033[K[{bar}] {text}")
            self._line_shown = True
        else:
            self.stream.write(f"train: {text}\n")
        self.stream.flush()
        self._last_draw = now

    def clear_line(self) -> None:
        if self._line_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._line_shown = False

    def close(self) -> None:
        if self._line_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._line_shown = False
        if self._log_filter is not None:
            logging.getLogger("dsplug").removeFilter(self._log_filter)
            self._log_filter = None
        if self._step_level is not None:
            step_logger.setLevel(self._step_level)
            self._step_level = None


class _ClearLineFilter(logging.Filter):
    """Clears the progress line before a log record is printed (the next update redraws it)."""

    def __init__(self, bar: ProgressBar):
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.clear_line()
        return True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
