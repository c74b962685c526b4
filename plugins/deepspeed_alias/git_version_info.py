"""``deepspeed.git_version_info``: what this installation is and what it was built with.

DeepSpeed writes these values into its package when it is built; dsplug answers them from the
running installation instead:

* ``version`` -- the DeepSpeed version the ``deepspeed`` name reports (``0.19.8+dsplug.0.1.0``:
  the DeepSpeed API level dsplug implements, dsplug's version as the local part); what
  ``deepspeed.__version__`` is under the alias and what elasticity's ``target_deepspeed_version``
  compares against;
* ``git_hash`` / ``git_branch`` -- ``"unknown"`` (dsplug records no build-time git state);
* ``installed_ops`` -- per DeepSpeed op name, whether it was built ahead of time (``dsplug
  build-ops`` / ``pip install``); ``compatible_ops`` -- whether it can run here (what
  ``deepspeed.ops.__compatible_ops__`` says);
* ``accelerator_name`` -- the accelerator dsplug selects (``cpu``, ``cuda``);
* ``torch_info`` -- ``version`` (major.minor), ``bf16_support``, ``cuda_version``,
  ``nccl_version``, ``hip_version`` of the installed torch (``"0.0"`` where it has none).

The values are computed on first access (they import torch).
"""
from __future__ import annotations

from typing import Dict

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "accelerator_name",
           "torch_info"]

git_hash = "unknown"
git_branch = "unknown"


def _version() -> str:
    from .install import alias_version

    return alias_version()


def _major_minor(text) -> str:
    if not text:
        return "0.0"
    parts = str(text).split("+")[0].split(".")
    return ".".join((parts + ["0"])[:2])


def _torch_info() -> Dict[str, object]:
    import torch

    nccl = "0.0"
    if torch.cuda.is_available() and torch.version.cuda:
        try:
            nccl = ".".join(str(n) for n in torch.cuda.nccl.version()[:2])
        except (AttributeError, RuntimeError):
            nccl = "0.0"
    return {
        "version": _major_minor(torch.__version__),
        "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        "cuda_version": _major_minor(torch.version.cuda),
        "nccl_version": nccl,
        "hip_version": _major_minor(getattr(torch.version, "hip", None)),
    }


def _installed_ops() -> Dict[str, bool]:
    from dsplug.ops import compatible_ops
    from dsplug.op_builder import ALL_OPS

    built = {name: cls().is_built() for name, cls in ALL_OPS.items()}
    return {name: built.get(name, False) for name in compatible_ops()}


def _accelerator_name() -> str:
    from dsplug.accelerator import get_accelerator

    return get_accelerator().device_name()


def _compatible_ops() -> Dict[str, bool]:
    from dsplug.ops import compatible_ops

    return compatible_ops()


_COMPUTED = {"version": _version, "torch_info": _torch_info, "installed_ops": _installed_ops,
             "accelerator_name": _accelerator_name, "compatible_ops": _compatible_ops}


def __getattr__(name):
    if name in _COMPUTED:
        value = _COMPUTED[name]()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
