"""What the checkpoint hooks hand to plugins (see ``dsplug_checkpoint_state`` /
``dsplug_load_checkpoint_state`` in :mod:`dsplug.hookspecs`)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import attrs


@attrs.frozen
class SaveOptions:
    """How ``engine.save_checkpoint`` was called."""

    tag: str
    save_dir: str
    exclude_frozen_parameters: bool = False


@attrs.frozen
class LoadOptions:
    """How ``engine.load_checkpoint`` was called (DeepSpeed's flags)."""

    load_module_strict: bool = True
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False
    custom_load_fn: Optional[Callable[..., Any]] = None


@attrs.frozen
class CheckpointView:
    """A checkpoint being loaded, as every participant sees it.

    model:            the shared file's ``{key: state}`` (what ``scope="model"`` returned)
    rank:             this rank's file's ``{key: state}`` (what ``scope="rank"`` returned); when
                      the checkpoint has fewer ranks than this run, the last saved rank's file
    saved_world_size: how many ranks wrote it
    read_rank:        ``read_rank(r)`` -> rank ``r``'s ``{key: state}`` (re-slicing partitions)
    options:          the :class:`LoadOptions`
    path:             the tag directory
    """

    model: Dict[str, Any]
    rank: Dict[str, Any]
    saved_world_size: int
    read_rank: Callable[[int], Dict[str, Any]]
    options: LoadOptions
    path: str
