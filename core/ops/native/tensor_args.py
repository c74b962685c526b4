"""Checks that turn tensors into the raw pointers the C++ ops take, with errors naming the
argument at fault."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

# dtype codes shared with csrc/includes/dsplug_simd.h (enum DType)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_OUTPUT = -1


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_cpu_tensor(name: str, tensor, *, dtypes: Optional[Iterable[torch.dtype]] = None,
                     numel: Optional[int] = None, numel_of: str = "param") -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` unless ``tensor`` is a dense, contiguous CPU
    tensor (of one of ``dtypes``, with ``numel`` elements). Returns the tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} must be a dense tensor, got layout {tensor.layout}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}); "
                         f"call .contiguous() first")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if tensor.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {_names([tensor.dtype])}; expected {_names(dtypes)}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements but {numel_of} has {numel}")
    return tensor
