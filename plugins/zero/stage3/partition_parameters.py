"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` names (the kernel's
``dsplug.runtime.zero.partition_parameters`` forwards here): what ``dsplug.zero`` has
(:mod:`.api`), plus the module-level helpers scripts and integrations use while building a model
under ``Init``.
"""
from __future__ import annotations

import enum

import torch

from dsplug.accelerator import get_accelerator  # noqa: F401  (transformers reads it from here)

from .api import GatheredParameters, Init, ZeroParamStatus, is_zero_param, register_external_parameter, \
    unregister_external_parameter
from .init import _patcher


class ZeroParamType(enum.Enum):
    """DeepSpeed's kinds of parameters (dsplug partitions parameters in memory: ``PARTITIONED``)."""

    NORMAL = 1  # a whole parameter, not partitioned
    PARTITIONED = 2  # partitioned over the data-parallel ranks
    REMOTE = 3  # partitioned, with the partition somewhere else (offloaded)


#: ``param.data.shape`` of a partitioned parameter while it is not gathered: an empty placeholder
#: (the partition is ``param.ds_tensor``, the full shape ``param.ds_shape``)
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several in-flight all-gathers waited as one (``ParamPartitioner.gather_async`` returns one
    handle per dtype). ``wait(**kwargs)`` waits each handle in order, passing the keyword arguments
    on as keywords (``handle_dependency=False`` reaches a handle whose ``wait`` takes it
    positionally, keyword-only or as ``**kwargs`` alike)."""

    def __init__(self, handles):
        self.handles = list(handles)

    def wait(self, **kwargs) -> None:
        for handle in self.handles:
            handle.wait(**kwargs)

    def __len__(self) -> int:
        return len(self.handles)


def shutdown_init_context() -> None:
    """Stop partitioning new modules while ``Init`` contexts are active (until
    :func:`restore_init_context`): modules built in between stay whole."""
    _patcher.suspend()


def restore_init_context() -> None:
    """Partition new modules again inside the active ``Init`` contexts."""
    _patcher.resume()


#: torch.arange as it was before any ``Init`` (transformers restores it from here)
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """DeepSpeed wraps tensor constructors under ``Init`` to cast new floating-point tensors to the
    training dtype. dsplug's ``Init`` partitions parameters as modules are built and leaves tensor
    constructors alone, so this returns ``fn`` unchanged (transformers calls it around
    ``torch.arange`` while building a model under ZeRO-3)."""
    return fn


def zero_init_enabled() -> bool:
    """Whether a ``dsplug.zero.Init`` context partitions modules being built now."""
    return bool(_patcher.active) and not _patcher.suspended


__all__ = ["GatheredParameters", "Init", "MultipleAllGatherHandles", "ZeroParamStatus",
           "partitioned_param_data_shape", "ZeroParamType", "is_zero_param",
           "zero_wrapper_for_fp_tensor_constructor", "get_accelerator",
           "register_external_parameter", "restore_init_context", "shutdown_init_context",
           "unregister_external_parameter", "zero_init_enabled"]
