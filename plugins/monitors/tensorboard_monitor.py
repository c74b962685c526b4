"""The ``tensorboard`` monitor: TensorBoard event files under ``output_path/job_name``.

Written through ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard``
package (``pip install dsplug[tensorboard]``).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from dsplug import PluginSpec

from .config import TensorBoardConfig
from .events import Event, MonitorObserver, build_client_monitor, resolve_log_dir

#: seconds between the SummaryWriter's background flushes: a running TensorBoard sees new
#: points this often, while a step only queues events in memory.
FLUSH_SECS = 10
#: events the SummaryWriter queues for its writer thread before a step has to wait. Its default
#: (10) makes the training loop wait on the thread's pure-Python CRC work.
MAX_QUEUE = 1000


class TensorBoardWriter(MonitorObserver):
    """Scalars in TensorBoard event files, one point per tag and optimizer step.

    The tags of one step go into a single event (one ``Summary`` with several values, as
    TensorFlow's own summary writers do), not one event per tag: each event costs the writer
    thread a pure-Python CRC, so this cuts the per-step work several-fold.
    """

    section = "tensorboard"

    def __init__(self, log_dir: str, flush_secs: int = FLUSH_SECS, max_queue: int = MAX_QUEUE):
        super().__init__()
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.summary_writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs, max_queue=max_queue)
        self._summary = Summary
        self._file_writer = getattr(self.summary_writer, "file_writer", None)

    def _write(self, events: List[Event]) -> None:
        if self._file_writer is None:  # a SummaryWriter without the file_writer attribute
            for tag, value, step in events:
                self.summary_writer.add_scalar(tag, value, step)
            return
        by_step: Dict[int, list] = {}
        for tag, value, step in events:
            by_step.setdefault(step, []).append(self._summary.Value(tag=tag, simple_value=value))
        for step, values in by_step.items():
            self._file_writer.add_summary(self._summary(value=values), step)

    def _flush(self) -> None:
        self.summary_writer.flush()

    def _close(self) -> None:
        self.summary_writer.flush()
        self.summary_writer.close()


def build(config: TensorBoardConfig, context) -> Optional[TensorBoardWriter]:
    return build_client_monitor(config, context, "tensorboard", "tensorboard",
                                lambda _: TensorBoardWriter(resolve_log_dir(config.output_path, config.job_name)))


def specs():
    """This monitor's spec (registered by :mod:`.plugin`)."""
    return [
        PluginSpec(
            category="monitor",
            name="tensorboard",
            section="tensorboard",
            schema=TensorBoardConfig,
            factory=build,
            summary="TensorBoard event files under output_path/job_name (pip install dsplug[tensorboard])",
        )
    ]
