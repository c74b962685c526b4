"""Optimizers and LR schedulers: the torch shapes the engine relies on."""
from __future__ import annotations

from typing import Any, Dict, List, Protocol, runtime_checkable


@runtime_checkable
class Optimizer(Protocol):
    """What an optimizer factory returns: a ``torch.optim.Optimizer`` (subclass it).

    The ZeRO stage calls ``step()`` once per applied step after it has put the (reduced,
    unscaled, clipped) gradients into ``.grad`` of the tensors in ``param_groups`` (fp32 master
    partitions at stages 1-3). ``param_groups[i]["lr"]`` is what schedulers set and
    ``engine.get_lr()`` reads. ``state_dict()`` / ``load_state_dict()`` must round-trip exactly
    (stage 0 saves them as they are; stages 1-3 save per-element state aligned with the
    partition, so element-wise state must be tensors shaped like the parameter).

    Optional: ``communicates_gradients() -> bool`` — True when the next ``step()`` averages the
    gradient information over the data-parallel ranks itself (1-bit Adam's compressed momentum,
    0/1 Adam's local steps). ZeRO stage 0 asks it at the last micro-step's
    ``before_backward(is_boundary=True)``; when True it skips its gradient all-reduce for that
    step and hands each rank's LOCAL gradients (unscaled, clipped) to ``step()``. The overflow
    check (fp16) still agrees over the ranks (every rank skips the same steps); gradient
    clipping and the reported gradient norm then use this rank's local norm. The answer must be
    the same on every rank, and must not change between that backward and the step. Absent:
    False. Stages 1-3 never skip their reduction (such optimizers are refused there).
    """

    param_groups: List[Dict[str, Any]]

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...


@runtime_checkable
class LRScheduler(Protocol):
    """What a scheduler factory returns.

    ``step()``: called by the engine once per *applied* optimizer step (not on skipped steps),
    after the optimizer step; it sets ``lr`` (and momentum) on the optimizer's groups.
    ``get_last_lr()``: the lr of each group after the last step. ``state_dict()`` /
    ``load_state_dict()``: saved in the shared checkpoint file; a resumed run continues the
    schedule exactly.
    """

    def step(self, *args, **kwargs) -> None: ...

    def get_last_lr(self) -> List[float]: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...
