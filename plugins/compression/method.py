"""What the scheduled compression methods share: group resolution, the step schedule, state.

A method resolves its ``different_groups`` against the model at :meth:`compress` (converting each
selected layer to a compressed layer and attaching its part), then follows the training steps:
``on_step(global_steps)`` runs after every applied optimizer step and calls
:meth:`apply_schedule`, which each method defines from its ``schedule_offset`` and periods.
The step counter is the method's checkpoint state, so a resumed run continues the schedule;
masks, scores and calibrated ranges live in the layers (buffers / Parameters, saved with the
model).
"""
from __future__ import annotations

import abc
import contextlib
import threading
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from dsplug.contracts import CompressionMethod

from . import selection
from .layers import CompressedLayer, compressed


#: where the methods that compressed a model are kept (read by ``redundancy_clean``)
METHODS_ATTRIBUTE = "_dsplug_compression_methods"


class CompressionTarget:
    """One selected layer of one group: its name, layer, group settings and related modules."""

    def __init__(self, name: str, layer: CompressedLayer, group_name: str, group: Any, related: List[str]):
        self.name = name
        self.layer = layer
        self.group_name = group_name
        self.group = group
        self.related = related  # dotted names of the related modules (resolved at compress)


def _gathering(params, modifier_rank):
    """The context manager of the ZeRO stage(s) that hold some of ``params`` partitioned (the
    kernel's ``gathered_parameters``: each stage's ``ZeroStage.gathered``), or None when none is
    partitioned."""
    from dsplug.contracts.zero_stage import gathered_parameters

    return gathered_parameters(list(params), modifier_rank)


def is_partitioned(params) -> bool:
    """True when a ZeRO stage holds some of these parameters partitioned (stage 3 and fsdp2 do)."""
    return _gathering([p for p in params if p is not None], None) is not None


_whole = threading.local()  # inside gathered(..., whole_model=True): everything is gathered already


@contextlib.contextmanager
def gathered(params, modify: bool = False, whole_model: bool = False):
    """Full parameters inside the block: the ZeRO stage's ``GatheredParameters`` for partitioned
    ones (changes written back from rank 0 when ``modify``), nothing to do otherwise.
    ``whole_model`` marks a block that gathered every parameter (nested calls then do nothing)."""
    params = [p for p in params if p is not None]
    context = None if getattr(_whole, "active", False) else _gathering(params, 0 if modify else None)
    if context is None:
        yield
        return
    with context:
        _whole.active = whole_model
        try:
            yield
        finally:
            _whole.active = False


class ScheduledMethod(CompressionMethod):
    """Base of the six group-based methods (all but layer reduction)."""

    #: config key under compression_training (set by each method)
    kind = ""
    #: redundancy_clean order: quantization is baked in before pruning shrinks layers
    clean_order = 1

    def __init__(self, config, context=None):
        super().__init__(config, context)
        self.name = self.kind
        self.step = 0
        self.model: Optional[nn.Module] = None
        self.targets: List[CompressionTarget] = []

    @property
    def shared(self):
        return self.config.shared_parameters

    @property
    def enabled(self) -> bool:
        return bool(self.shared.enabled)

    @property
    def path(self) -> str:
        return f"compression_training.{self.kind}"

    def kinds(self):
        """The layer classes this method applies to."""
        from .layers import COMPRESSIBLE

        return COMPRESSIBLE

    def groups(self) -> Dict[str, Any]:
        return dict(self.config.different_groups)

    def excluded(self) -> List[str]:
        return []

    # -- CompressionMethod
    def compress(self, model: nn.Module) -> nn.Module:
        if not self.enabled:
            return model
        self.model = model
        self.targets = []
        owner: Dict[str, str] = {}
        for group_name, group in self.groups().items():
            gpath = f"{self.path}.different_groups.{group_name}"
            matched = selection.match(model, group.modules, f"{gpath}.modules", self.kinds(), self.excluded())
            for name, module, index in matched:
                if name in owner:
                    raise selection.CompressionConfigError(
                        f"{gpath}.modules: {name!r} is already selected by group {owner[name]!r} of {self.path}; "
                        f"a layer belongs to one group")
                owner[name] = group_name
                patterns = selection.related_patterns(getattr(group, "related_modules", None), index,
                                                      len(group.modules), f"{gpath}.related_modules")
                related = [n for n, _ in selection.related(model, name, patterns, f"{gpath}.related_modules")]
                layer = compressed(module)
                target = CompressionTarget(name, layer, group_name, group, related)
                try:
                    self.attach(target)
                except selection.CompressionConfigError as exc:
                    raise selection.CompressionConfigError(f"{gpath}: {name!r}: {exc}") from None
                self.targets.append(target)
        self.apply_schedule(self.step, starting=True)
        # redundancy_clean finds the method (its step, its targets) on the model
        model.__dict__.setdefault(METHODS_ATTRIBUTE, {})[self.name] = self
        return model

    def on_step(self, global_steps: int) -> None:
        if self.enabled:
            self.step = int(global_steps)
            self.apply_schedule(self.step)

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        if self.enabled and self.targets:
            self.apply_schedule(self.step, resumed=True)

    # -- for the methods
    @abc.abstractmethod
    def attach(self, target: CompressionTarget) -> None:
        """Give ``target.layer`` this method's part (a mask, a quantizer)."""

    @abc.abstractmethod
    def apply_schedule(self, step: int, starting: bool = False, resumed: bool = False) -> None:
        """Set the layers' state for ``step`` (``starting``: at compress; ``resumed``: after a load)."""

    def world_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over the data-parallel ranks (a no-op on one process)."""
        context = self.context
        if context is None or context.world_size <= 1 or context.comm is None:
            return tensor
        context.comm.all_reduce(tensor)
        return tensor.div_(context.world_size)
