"""Observers and monitors: plugins that watch training through the lifecycle hooks."""
from __future__ import annotations

import abc
from typing import Any, List, Mapping, Tuple

from ..hookspecs import hookimpl

#: DeepSpeed's monitor event: ``(tag, value, step)``; the step is ``global_samples``.
Event = Tuple[str, float, int]

#: step metric -> the tag DeepSpeed's monitors write it under
METRIC_TAGS: Tuple[Tuple[str, str], ...] = (
    ("loss", "Train/Samples/train_loss"),
    ("lr", "Train/Samples/lr"),
    ("loss_scale", "Train/Samples/loss_scale"),
    ("forward_ms", "Train/Samples/elapsed_time_ms_forward"),
    ("backward_ms", "Train/Samples/elapsed_time_ms_backward"),
    ("backward_inner_ms", "Train/Samples/elapsed_time_ms_backward_inner"),
    ("backward_allreduce_ms", "Train/Samples/elapsed_time_ms_backward_allreduce"),
    ("step_ms", "Train/Samples/elapsed_time_ms_step"),
)


class Observer:
    """What an ``observer`` factory returns: any object whose methods are lifecycle hook
    implementations (``@dsplug.hookimpl def dsplug_step_end(self, engine, metrics)``...; see
    :class:`dsplug.hookspecs.LifecycleSpecs`). The engine registers it on its event bus for its
    lifetime. Subclassing is optional; it documents intent and gives ``name``.

    To keep state across restarts implement ``dsplug_checkpoint_state`` (return
    ``{"<your-name>.<key>": value}`` for ``scope == "model"``) and
    ``dsplug_load_checkpoint_state`` (read ``checkpoint.model.get("<your-name>.<key>")``).
    """

    name: str = "observer"


class Monitor(Observer):
    """What a ``monitor`` factory returns: a metric sink with DeepSpeed's ``write_events``.

    After each optimizer step the engine's ``dsplug_step_end`` reaches :meth:`on_step_end`, which
    turns the metrics into events (:func:`events_from_metrics`) and calls :meth:`write_events`.
    Only rank 0 should write (the factory may return None on other ranks, or keep
    ``enabled = False``). Flush in ``dsplug_engine_closed``.
    """

    enabled: bool = True

    @abc.abstractmethod
    def write_events(self, events: List[Event]) -> None:
        """Write ``[(tag, value, step), ...]``."""

    def on_step_end(self, metrics: Mapping[str, Any]) -> None:
        if self.enabled:
            self.write_events(events_from_metrics(metrics))

    @hookimpl
    def dsplug_step_end(self, metrics):
        self.on_step_end(metrics)


def events_from_metrics(metrics: Mapping[str, Any]) -> List[Event]:
    """The events of one optimizer step; metrics that are absent or None are left out.

    The kernel's metrics are written under their :data:`METRIC_TAGS` tag; a metric a plugin adds
    in ``dsplug_step_end`` under a monitor tag as its name (one containing ``/``, e.g.
    ``Train/Samples/activation_checkpoint_ms``) is written under that name (add it from a
    ``@hookimpl(tryfirst=True)`` implementation so that it is there before the monitors run).
    """
    if "global_samples" not in metrics:
        raise KeyError(f"step metrics lack 'global_samples' (the x axis of every monitor); got keys {sorted(metrics)}")
    step = int(metrics["global_samples"])
    events = [(tag, _scalar(metrics[key]), step) for key, tag in METRIC_TAGS if metrics.get(key) is not None]
    events += [(key, _scalar(value), step) for key, value in metrics.items() if "/" in key and value is not None]
    return events


def _scalar(value) -> float:
    item = getattr(value, "item", None)  # a 0-d tensor or numpy scalar
    return float(item() if callable(item) else value)
