"""The compression-method contract (``compression_training``)."""
from __future__ import annotations

import abc
from typing import Any, Dict

from ..hookspecs import hookimpl


class CompressionMethod(abc.ABC):
    """What a ``compression`` factory returns: one method under ``compression_training``.

    Built by the engine at initialize from ``factory(section, context)`` (None: disabled), in order
    of ``PluginSpec.priority`` (highest first; layer reduction runs before the layer methods), then
    config order:

    1. :meth:`compress` transforms the model before the ZeRO stage wraps it (wrap or replace
       modules). Keep the existing ``nn.Parameter`` objects where you can: an optimizer or
       ``model_parameters`` the user passed refers to them. The engine re-collects trainable
       parameters from the returned model when it chose the parameters itself.
    2. :meth:`on_step` runs after every applied optimizer step with the new ``global_steps``:
       the place for schedules (``schedule_offset``, bit-width periods, mask updates).
    3. :meth:`state_dict` / :meth:`load_state_dict` are saved in the shared checkpoint file under
       ``"compression.<name>"`` and restored on load, so a resumed run continues the schedule.
    4. :meth:`clean` (``redundancy_clean``) returns the physically smaller model after training.
    """

    #: the key under ``compression_training`` (set by the factory or the subclass)
    name: str = "compression"

    def __init__(self, config: Any = None, context: Any = None):
        self.config = config
        self.context = context

    @abc.abstractmethod
    def compress(self, model):
        """Return the model with this method applied (at initialize)."""

    def on_step(self, global_steps: int) -> None:
        """An optimizer step was applied; ``global_steps`` counts them."""

    def clean(self, model):
        """Return the model with what this method made redundant removed (default: unchanged)."""
        return model

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    # -- lifecycle participation (see dsplug.hookspecs)
    @property
    def checkpoint_key(self) -> str:
        return f"compression.{self.name}"

    @hookimpl
    def dsplug_step_end(self, engine, metrics):
        if metrics.get("skipped", 0.0) == 0.0:
            self.on_step(int(engine.global_steps))

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {self.checkpoint_key: self.state_dict()} if scope == "model" else None

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        state = checkpoint.model.get(self.checkpoint_key)
        if state is not None and not checkpoint.options.load_module_only:
            self.load_state_dict(state)
