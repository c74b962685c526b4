"""The monitor: a :class:`dsplug.contracts.Monitor` with checkpointed state."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional

from dsplug import hookimpl
from dsplug.contracts import Monitor
from dsplug.contracts.observer import Event, events_from_metrics

FILE_NAME = "events.jsonl"
EMA_TAG = "Train/Samples/train_loss_ema"
#: the key of this monitor's state in the checkpoint's shared file
STATE_KEY = "jsonl_monitor.state"


def events_path(output_path: Optional[str], job_name: str) -> str:
    """``output_path/job_name/events.jsonl``; an empty ``output_path`` means the launch directory."""
    base = os.path.expanduser(output_path) if output_path else os.getcwd()
    return os.path.abspath(os.path.join(base, job_name, FILE_NAME))


def read_events(path: str) -> List[Event]:
    """The ``(tag, value, step)`` events in a file this monitor wrote."""
    with open(path, encoding="utf-8") as f:
        return [(r["tag"], float(r["value"]), int(r["step"])) for r in map(json.loads, f) if r]


class JsonlMonitor(Monitor):
    """Appends one JSON object per event to :attr:`path` and tracks the loss.

    State (saved with every checkpoint, restored on load): ``loss_ema``, ``best_loss``,
    ``events_written``, ``steps_seen``.
    """

    name = "jsonl_monitor"

    def __init__(self, path: str, ema_beta: float = 0.9):
        self.path = path
        self.ema_beta = float(ema_beta)
        self.loss_ema: Optional[float] = None
        self.best_loss: Optional[float] = None
        self.events_written = 0
        self.steps_seen = 0
        self._file = None

    # -- the Monitor contract
    def on_step_end(self, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        events = events_from_metrics(metrics)
        self.steps_seen += 1
        loss = metrics.get("loss")
        if loss is not None and math.isfinite(float(loss)) and not metrics.get("skipped", 0.0):
            loss = float(loss)
            b = self.ema_beta
            self.loss_ema = loss if self.loss_ema is None else b * self.loss_ema + (1.0 - b) * loss
            self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
            events.append((EMA_TAG, self.loss_ema, int(metrics["global_samples"])))
        self.write_events(events)

    def write_events(self, events: List[Event]) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        for tag, value, step in events:
            item = getattr(value, "item", None)
            value = float(item() if callable(item) else value)
            self._file.write(json.dumps({"tag": str(tag), "value": value, "step": int(step)}) + "\n")
            self.events_written += 1
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- state
    def state_dict(self) -> Dict[str, Any]:
        return {"loss_ema": self.loss_ema, "best_loss": self.best_loss, "events_written": self.events_written,
                "steps_seen": self.steps_seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss_ema = state.get("loss_ema")
        self.best_loss = state.get("best_loss")
        self.events_written = int(state.get("events_written", 0))
        self.steps_seen = int(state.get("steps_seen", 0))

    # -- lifecycle hooks (dsplug.hookspecs): state through checkpoints, the file closed at the end
    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {STATE_KEY: self.state_dict()} if scope == "model" else None

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        state = checkpoint.model.get(STATE_KEY)  # absent in a checkpoint from before this plugin
        if state is not None and not checkpoint.options.load_module_only:
            self.load_state_dict(state)

    @hookimpl
    def dsplug_engine_closed(self):
        self.close()
