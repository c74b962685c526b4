"""Temporarily replace torch functions by counting wrappers, and always put the originals back.

While a :class:`FunctionPatch` is installed, each listed function (``torch.nn.functional.linear``,
``torch.matmul``, ``Tensor.__matmul__``, ...) runs as usual and then reports the FLOPs / MACs of
the call to a sink. A call made *inside* another counted call (``F.relu`` calling ``torch.relu``,
``x @ y`` on a subclass calling ``torch.matmul``) is not counted again.

Only one patch can be installed at a time: the functions are process-wide.
"""
from __future__ import annotations

import functools
import threading
import warnings
from typing import Callable, List, Optional, Tuple

from . import counters

_NOT_SET = object()
_state = threading.local()  # .depth: how many counted calls this thread is inside
_install_lock = threading.Lock()
_installed: Optional["FunctionPatch"] = None


def _targets() -> List[Tuple[object, str, Callable]]:
    """(owner, attribute, counter) for every function the profiler counts."""
    import torch
    import torch.nn.functional as F

    T = torch.Tensor
    rows = [
        (F, "linear", counters.linear),
        (F, "scaled_dot_product_attention", counters.scaled_dot_product_attention),
        (F, "layer_norm", counters.layer_norm),
        (F, "group_norm", counters.group_norm),
        (F, "instance_norm", counters.instance_norm),
        (F, "batch_norm", counters.batch_norm),
        (F, "embedding", counters.nothing),
        (F, "interpolate", counters.per_output_element),
        (F, "upsample", counters.per_output_element),
        (torch, "einsum", counters.einsum),
    ]
    rows += [(F, name, counters.conv) for name in ("conv1d", "conv2d", "conv3d")]
    rows += [(F, name, counters.conv_transpose) for name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")]
    activations = ("relu", "relu6", "hardtanh", "elu", "leaky_relu", "prelu", "silu", "gelu", "hardswish",
                   "hardsigmoid", "mish", "softplus", "softmax")
    rows += [(F, name, counters.per_output_element) for name in activations]
    rows += [(owner, name, counters.per_output_element)
             for owner in (torch, T) for name in ("relu", "tanh", "sigmoid", "softmax", "add", "mul")]
    pools = [f"{kind}_pool{d}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max") for d in (1, 2, 3)]
    rows += [(F, name, counters.per_input_element) for name in pools]
    rows += [(owner, name, counters.matmul) for owner in (torch, T) for name in ("matmul", "mm", "bmm")]
    rows += [(T, "__matmul__", counters.matmul)]
    rows += [(owner, name, counters.addmm) for owner in (torch, T) for name in ("addmm", "baddbmm")]
    return [row for row in rows if hasattr(row[0], row[1])]


class FunctionPatch:
    """Counting wrappers around the functions of :func:`_targets`.

    ``sink(name, flops, macs)`` receives every counted call. Use as a context manager or call
    :meth:`install` / :meth:`restore` (restore is idempotent and undoes exactly what install did).
    """

    def __init__(self, sink: Callable[[str, int, int], None]):
        self.sink = sink
        self._saved: List[Tuple[object, str, object]] = []
        self._warned = set()

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def install(self) -> "FunctionPatch":
        global _installed
        with _install_lock:
            if _installed is not None:
                raise RuntimeError(
                    "another flops profile is already counting torch functions in this process; "
                    "call stop_profile() (or end_profile()) on that profiler first")
            _installed = self
        try:
            for owner, name, counter in _targets():
                before = owner.__dict__.get(name, _NOT_SET) if isinstance(owner, type) else getattr(owner, name)
                original = getattr(owner, name)
                self._saved.append((owner, name, before))
                setattr(owner, name, self._wrap(original, counter, f"{getattr(owner, '__name__', owner)}.{name}"))
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        global _installed
        while self._saved:
            owner, name, before = self._saved.pop()
            if before is _NOT_SET:
                delattr(owner, name)  # the class had inherited it: drop our override
            else:
                setattr(owner, name, before)
        with _install_lock:
            if _installed is self:
                _installed = None

    def __enter__(self) -> "FunctionPatch":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _wrap(self, original, counter, name):
        sink = self.sink

        @functools.wraps(original)
        def counted(*args, **kwargs):
            depth = getattr(_state, "depth", 0)
            if depth:
                return original(*args, **kwargs)
            _state.depth = 1
            try:
                out = original(*args, **kwargs)
            finally:
                _state.depth = 0
            if out is not NotImplemented:
                try:
                    flops, macs = counter(out, *args, **kwargs)
                except Exception as exc:  # counting must never break the user's forward pass
                    self._warn_once(name, exc)
                else:
                    sink(name, int(flops), int(macs))
            return out

        return counted

    def _warn_once(self, name: str, exc: Exception) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"flops profiler: a call of {name} was not counted ({exc}); it counts as 0 FLOPs",
                          RuntimeWarning, stacklevel=4)


def installed_patch() -> Optional[FunctionPatch]:
    """The patch currently installed in this process, if any."""
    return _installed
