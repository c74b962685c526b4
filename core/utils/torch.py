"""DeepSpeed's ``deepspeed.utils.torch``: checks of the installed torch version."""
from __future__ import annotations

from typing import Optional, Tuple


def _major_minor(version: str) -> Tuple[int, int]:
    parts = (version.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def _bound(value) -> Tuple[int, int]:
    """``1.8`` / ``"2.1"`` / ``(2, 1)`` -> (major, minor)."""
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1]) if len(value) > 1 else 0
    return _major_minor(str(value))


def required_torch_version(min_version: Optional[object] = None, max_version: Optional[object] = None) -> bool:
    """Whether the installed torch's major.minor lies in ``[min_version, max_version]`` (either bound
    optional; ``1.8``, ``"2.1"`` or ``(2, 1)``). Only major and minor count, as in DeepSpeed."""
    import torch

    installed = _major_minor(torch.__version__)
    if min_version is not None and installed < _bound(min_version):
        return False
    if max_version is not None and installed > _bound(max_version):
        return False
    return True


__all__ = ["required_torch_version"]
