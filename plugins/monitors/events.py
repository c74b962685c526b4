"""The parts the monitors share: a background-thread writer on top of the kernel's contract.

An *event* is DeepSpeed's monitor tuple ``(tag, value, step)``; the step is the number of
samples seen (``global_samples``), so curves of runs with different batch sizes line up. The
tags and the metrics -> events conversion are the kernel's (:mod:`dsplug.contracts.observer`:
``METRIC_TAGS``, ``events_from_metrics``), re-exported here.
"""
from __future__ import annotations

import abc
import atexit
import importlib
import importlib.util
import os
import queue
import threading
from typing import Iterable, List

from dsplug import hookimpl
from dsplug.contracts.observer import METRIC_TAGS, Event, Monitor, events_from_metrics

__all__ = ["METRIC_TAGS", "Event", "MissingExtraError", "MonitorObserver", "build_client_monitor",
           "events_from_metrics", "is_writer", "require_package", "resolve_log_dir"]


def resolve_log_dir(output_path, job_name: str) -> str:
    """``output_path/job_name``; an empty or null ``output_path`` means the launch directory.

    DeepSpeed joins ``""`` with the job name, i.e. writes under the current directory; this
    makes that directory absolute so a later ``chdir`` in the training script cannot move it.
    """
    base = os.path.expanduser(output_path) if output_path else os.getcwd()
    return os.path.abspath(os.path.join(base, job_name))


def is_writer(context) -> bool:
    """Only rank 0 writes (no context: standalone use, a single process)."""
    return context is None or getattr(context, "rank", 0) == 0


class MissingExtraError(ImportError):
    """An enabled monitor's client library is not installed."""


def require_package(module: str, *, section: str, extra: str, load: bool = True):
    """Import ``module`` (or, with ``load=False``, only check it is installed) or fail clearly.

    Ranks that will not write check without importing, so a missing package fails every rank
    at the same point instead of leaving the others waiting for rank 0.
    """
    hint = (f"the {section!r} monitor is enabled ({section}.enabled=true) but its client library "
            f"{module!r} is not installed; install it with: pip install dsplug[{extra}] "
            f"(or set {section}.enabled=false)")
    if not load:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingExtraError(hint)
        return None
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{hint} [import error: {exc}]") from exc


def build_client_monitor(config, context, package: str, section: str, make):
    """The shared factory of monitors backed by a client library: nothing when disabled; the
    package is checked on every rank (so a missing extra fails everywhere, not only on rank 0);
    ``make(module)`` builds the observer on the writing rank only."""
    if not config.enabled:
        return None
    writer = is_writer(context)
    module = require_package(package, section=section, extra=section, load=writer)
    return make(module) if writer else None


class MonitorObserver(Monitor, abc.ABC):
    """Base of the monitors the monitor factories return (a :class:`dsplug.contracts.Monitor`).

    The engine registers the object on its event bus; the contract's ``dsplug_step_end`` turns
    each step's metrics into events and calls :meth:`write_events`. DeepSpeed-style client code
    may also call :meth:`write_events` directly with ``(tag, value, step)`` tuples.

    Writing happens on one background thread per monitor: the training step only queues its
    events, so a slow client library (wandb, comet) never adds to the step time. Events keep
    their order; :meth:`flush` waits until every queued event is written, :meth:`close` drains
    and releases. A failure in the writer is raised on the next call from the training thread.
    Subclasses implement ``_write(events)``, ``_flush()`` and ``_close()`` (run on the writer
    thread, or after it has stopped).
    """

    #: the config section (and plugin name) this observer belongs to
    section = ""
    enabled = True
    _STOP = object()

    @property
    def name(self) -> str:
        return self.section

    def __init__(self) -> None:
        self.closed = False
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._writer: threading.Thread = None
        self._error: BaseException = None
        atexit.register(self.close)

    def write_events(self, events: Iterable[Event]) -> None:
        if self.closed:
            raise RuntimeError(f"the {self.section} monitor is closed; it cannot write {list(events)!r}")
        self._raise_writer_error()
        if self._writer is None:
            self._writer = threading.Thread(target=self._drain, name=f"dsplug-{self.section}-writer", daemon=True)
            self._writer.start()
        self._queue.put([(str(tag), float(value), int(step)) for tag, value, step in events])

    def flush(self) -> None:
        """Write everything queued so far and hand it to the OS / the client library."""
        self._wait_for_queue()
        self._raise_writer_error()
        self._flush()

    def close(self) -> None:
        """Drain, flush and release files / runs. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self._writer is not None:
            self._queue.put(self._STOP)
            self._writer.join()
        self._close()
        self._raise_writer_error()

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = self._error or exc

    def _wait_for_queue(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the {self.section} monitor failed to write: {type(error).__name__}: {error}") \
                from error

    @hookimpl
    def dsplug_engine_closed(self, engine):
        self.close()

    # subclass interface -------------------------------------------------------------------
    @abc.abstractmethod
    def _write(self, events: List[Event]) -> None:
        """Record already-normalised ``(tag, float, int)`` events (on the writer thread)."""

    @abc.abstractmethod
    def _flush(self) -> None:
        """Hand everything written so far to the OS / the client library."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Flush and release resources (called once, after the writer thread stopped)."""
