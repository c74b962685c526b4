"""``"auto"`` values, as Hugging Face's DeepSpeed integration writes them.

:func:`fill_auto` is the public helper: it replaces ``"auto"`` in a raw config dict from the
values given (by dotted JSON path or by bare key name) and, given ``hidden_size``, what the
plugins derive from the model through the ``dsplug_auto_value`` hook (the ZeRO plugin: bucket
sizes hidden², 0.9·hidden², 10·hidden). Batch sizes left ``"auto"`` are inferred from the other
two and the world size.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from .schema import is_auto

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def auto_paths(raw: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Yield the dotted path of every ``"auto"`` value in ``raw``."""
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from auto_paths(value, path)
        elif is_auto(value):
            yield path, value


def _set(raw: Dict[str, Any], path: str, value) -> None:
    node = raw
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value


def fill_auto(
    config: Mapping[str, Any],
    values: Optional[Mapping[str, Any]] = None,
    *,
    hidden_size: Optional[int] = None,
    registry=None,
) -> Dict[str, Any]:
    """A copy of ``config`` with its ``"auto"`` values filled in.

    ``values`` maps a dotted path (``"optimizer.params.lr"``) or a bare key name (``"lr"``,
    matching any key of that name) to its value; a dotted path wins over a bare name.
    Values that nothing given resolves are left ``"auto"``.
    """
    values = dict(values or {})
    out = copy.deepcopy(dict(config))
    for path, _ in list(auto_paths(out)):
        leaf = path.rsplit(".", 1)[-1]
        if path in values:
            _set(out, path, values[path])
        elif leaf in values:
            _set(out, path, values[leaf])
        elif hidden_size is not None:
            if registry is None:
                from ..registry import get_registry

                registry = get_registry()
            derived = registry.pm.hook.dsplug_auto_value(path=path, hidden_size=int(hidden_size))
            if derived is not None:
                _set(out, path, derived)
    return out


def model_hidden_size(model) -> Optional[int]:
    """The hidden size Hugging Face reads from ``model.config`` (``hidden_size`` or the
    largest of ``hidden_sizes``), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if getattr(cfg, "hidden_size", None):
        return int(cfg.hidden_size)
    sizes = getattr(cfg, "hidden_sizes", None)
    if sizes:
        return int(max(sizes))
    return None
