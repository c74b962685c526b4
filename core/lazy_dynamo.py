"""Keep ``torch._dynamo`` unimported until something compiles: 2 s off every process's start.

torch wraps many methods with ``torch._disable_dynamo`` (``Optimizer.add_param_group``,
``zero_grad``, ``state_dict``, ``load_state_dict`` ...). The wrapper imports ``torch._dynamo``
on its first call in order to build a "run without dynamo" version of the method. That import
takes about 2 s of CPU (as long as ``import torch`` itself on a 2-core machine), and the first
``torch.optim`` optimizer a process builds pays it: every rank of every run, before its first
step.

Without ``torch._dynamo`` imported nothing can be compiling, so the disabled version is the
method itself. :func:`install` gives each such wrapped method a stand-in for the version torch
would build: while ``torch._dynamo`` is not in ``sys.modules`` it calls the method directly; from
the first call after anything imported ``torch._dynamo`` (``torch.compile`` does) on, it builds
torch's own disabled version and hands every later call to it, as torch would have. The stand-in
is stored where torch keeps its cached version (the wrapped function's ``__dynamo_disable``), so
nothing else changes. Where a torch release wraps differently, :func:`install` finds nothing to
do and torch behaves as it always does.
"""
from __future__ import annotations

import sys

#: the attribute on the wrapped function where torch caches its disabled version (torch/_compile.py)
CACHE_ATTR = "__dynamo_disable"


class _DisableOnDemand:
    """What ``torch._disable_dynamo``'s wrapper calls: the method itself until torch._dynamo is
    imported, torch's disabled version from then on."""

    def __init__(self, fn, recursive: bool):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return self.fn(*args, **kwargs)
        import torch._dynamo

        try:
            disabled = torch._dynamo.disable(self.fn, self.recursive, wrapping=False)  # as torch's wrapper builds it
        except TypeError:  # an older torch, whose disable has no `wrapping`
            disabled = torch._dynamo.disable(self.fn, self.recursive)
        setattr(self.fn, CACHE_ATTR, disabled)  # torch's own cache from here on
        return disabled(*args, **kwargs)


def _wrapped_parts(candidate, wrapper_code):
    """(fn, recursive) when ``candidate`` is a ``torch._disable_dynamo`` wrapper, else None."""
    code = getattr(candidate, "__code__", None)
    if code is not wrapper_code or candidate.__closure__ is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in candidate.__closure__)))
    fn, recursive = cells.get("fn"), cells.get("recursive", True)
    return (fn, bool(recursive)) if callable(fn) else None


def install(owners=None) -> int:
    """Give the ``torch._disable_dynamo``-wrapped functions of ``owners`` (classes or modules;
    default: ``torch.optim.Optimizer``, ``torch.utils.checkpoint`` and DDP, what a training run
    calls) the on-demand stand-in; returns how many it found. Idempotent."""
    import torch
    import torch.utils.checkpoint

    try:
        from torch import _compile

        wrapper_code = _compile._disable_dynamo(lambda: None).__code__  # the code object every wrapper shares
    except (ImportError, AttributeError):  # a torch without this helper: nothing to defer
        return 0
    if owners is None:
        owners = (torch.optim.Optimizer, torch.utils.checkpoint, torch.nn.parallel.DistributedDataParallel)
    found = 0
    for owner in owners:
        for value in list(vars(owner).values()):
            parts = _wrapped_parts(value, wrapper_code)
            if parts is None:
                continue
            fn, recursive = parts
            found += 1
            if getattr(fn, CACHE_ATTR, None) is None:  # torch has not built its version yet
                setattr(fn, CACHE_ATTR, _DisableOnDemand(fn, recursive))
    return found
