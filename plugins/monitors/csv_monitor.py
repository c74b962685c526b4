"""The ``csv_monitor`` monitor: one CSV file per metric under ``output_path/job_name``.

Layout, as DeepSpeed writes it: the file name is the tag with ``/`` and spaces replaced by
``_`` (``Train_Samples_train_loss.csv``); the header row is ``step,<last part of the tag>``
(``step,train_loss``); each row is ``<samples seen>,<value>``. Files are opened once and
appended to (a resumed job continues its files; the header is written only to a new file).
Rows are buffered and handed to the OS at most every :data:`FLUSH_INTERVAL_S` seconds and on
close, so a reader following the files sees progress without a syscall per step.
"""
from __future__ import annotations

import csv
import os
import time
from typing import Dict, List, Optional, Tuple

from dsplug import PluginSpec

from .config import CsvMonitorConfig
from .events import Event, MonitorObserver, is_writer, resolve_log_dir

FLUSH_INTERVAL_S = 1.0


def csv_file_name(tag: str) -> str:
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


def csv_header(tag: str) -> List[str]:
    return ["step", tag.rsplit("/", 1)[-1]]


class CsvMonitor(MonitorObserver):
    section = "csv_monitor"

    def __init__(self, log_dir: str, flush_interval_s: float = FLUSH_INTERVAL_S):
        super().__init__()
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.flush_interval_s = flush_interval_s
        self._files: Dict[str, Tuple[object, object]] = {}  # tag -> (file, csv writer)
        self._last_flush = time.monotonic()

    def path_of(self, tag: str) -> str:
        return os.path.join(self.log_dir, csv_file_name(tag))

    def _writer_for(self, tag: str):
        entry = self._files.get(tag)
        if entry is None:
            path = self.path_of(tag)
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            handle = open(path, "a", newline="", encoding="utf-8")
            writer = csv.writer(handle)
            if fresh:
                writer.writerow(csv_header(tag))
            entry = self._files[tag] = (handle, writer)
        return entry[1]

    def _write(self, events: List[Event]) -> None:
        for tag, value, step in events:
            self._writer_for(tag).writerow((step, value))
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self._flush()

    def _flush(self) -> None:
        for handle, _ in self._files.values():
            handle.flush()
        self._last_flush = time.monotonic()

    def _close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


def build(config: CsvMonitorConfig, context) -> Optional[CsvMonitor]:
    if not config.enabled or not is_writer(context):
        return None
    return CsvMonitor(resolve_log_dir(config.output_path, config.job_name))


def specs():
    """This monitor's spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="monitor",
            name="csv_monitor",
            section="csv_monitor",
            schema=CsvMonitorConfig,
            factory=build,
            summary="one CSV file per metric under output_path/job_name",
        )
    ]
