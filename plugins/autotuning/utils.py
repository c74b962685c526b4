"""DeepSpeed's ``deepspeed.autotuning.utils`` helpers on nested config dicts.

``get_val_by_key`` / ``set_val_by_key`` look a key up at any depth (the key itself, not a dotted
path): the getter returns the first value found depth-first in the dicts' order, the setter
replaces every occurrence. Dotted paths are :func:`.space.get_path`'s job.
"""
from __future__ import annotations

from typing import Any, Dict, Optional


def get_val_by_key(d: Dict[str, Any], k: str) -> Optional[Any]:
    """The value of key ``k`` in ``d`` or any dict nested in it (depth-first, in order); None when absent."""
    if k in d:
        return d[k]
    for value in d.values():
        if isinstance(value, dict):
            found = get_val_by_key(value, k)
            if found is not None:
                return found
    return None


def set_val_by_key(d: Dict[str, Any], k: str, vals: Any) -> None:
    """Set every occurrence of key ``k`` in ``d`` and the dicts nested in it to ``vals`` (in place);
    a key found nowhere is not added."""
    for key, value in d.items():
        if key == k:
            d[key] = vals
        elif isinstance(value, dict):
            set_val_by_key(value, k, vals)


__all__ = ["get_val_by_key", "set_val_by_key"]
