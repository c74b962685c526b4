"""Physical removal of pruned structure ("redundancy_clean"): pure module functions.

Every ``shrink_*`` function returns a NEW module holding copies of the kept slices (same dtype
and device, ``requires_grad`` as the original, same train/eval mode); the original module is
left untouched. New modules are built on the meta device and filled with the copies, so
shrinking never consumes the global RNG.

``keep`` arguments are either integer indices (a list or an integer tensor, kept in the given
order, no duplicates) or a 1-D bool / float mask over the dimension (non-zero = kept, converted
with :func:`keep_indices`). At least one index must be kept.

Index conventions (``H`` heads of width ``d``):

* ``shrink_linear_out``: ``W' = W[keep, :]``, ``b' = b[keep]``;
  ``shrink_linear_in``: ``W' = W[:, keep]``, ``b' = b``.
* ``shrink_conv_out``: ``W' = W[keep]``, ``b' = b[keep]``; ``shrink_conv_in``: ``W' = W[:, keep]``.
* ``shrink_batchnorm``: ``weight, bias, running_mean, running_var`` indexed by ``keep``.
* ``head_keep_indices(mask, d) = [h*d + j for kept h, j in range(d)]``.
* ``shrink_linear_heads_out(lin, mask, d, stacked=c)`` keeps output rows
  ``[k*H*d + i for k in range(c) for i in head_keep_indices(mask, d)]`` (chunk order kept,
  e.g. q|k|v for ``c = 3``).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

__all__ = [
    "keep_indices", "shrink_linear_out", "shrink_linear_in", "shrink_conv_out", "shrink_conv_in",
    "shrink_batchnorm", "head_keep_indices", "shrink_linear_heads_out", "shrink_linear_heads_in",
    "related_shrink", "replace_module",
]

Keep = Union[torch.Tensor, Sequence[int]]

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def keep_indices(mask_1d: torch.Tensor) -> torch.Tensor:
    """Sorted LongTensor of the positions where the 1-D ``mask_1d`` is non-zero."""
    if not isinstance(mask_1d, torch.Tensor) or mask_1d.dim() != 1:
        shape = tuple(mask_1d.shape) if isinstance(mask_1d, torch.Tensor) else type(mask_1d).__name__
        raise ValueError(f"keep_indices needs a 1-D mask, got {shape}")
    return torch.nonzero(mask_1d.detach() != 0, as_tuple=False).reshape(-1).to(torch.long)


def _index(keep: Keep, size: int, device, what: str) -> torch.Tensor:
    if isinstance(keep, torch.Tensor) and (keep.dtype == torch.bool or keep.is_floating_point()):
        if keep.dim() != 1 or keep.numel() != size:
            raise ValueError(f"{what}: mask of shape {tuple(keep.shape)} does not match dimension size {size}")
        idx = keep_indices(keep)
    else:
        idx = torch.as_tensor(keep, dtype=torch.long).detach().reshape(-1)
        if isinstance(keep, torch.Tensor) and keep.dim() > 1:
            raise ValueError(f"{what}: keep indices must be 1-D, got shape {tuple(keep.shape)}")
    if idx.numel() == 0:
        raise ValueError(f"{what}: nothing kept (keep is empty); a layer needs at least one unit")
    if int(idx.min()) < 0 or int(idx.max()) >= size:
        raise ValueError(f"{what}: keep indices must be in [0, {size}), got min {int(idx.min())} max {int(idx.max())}")
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{what}: keep indices contain duplicates")
    return idx.to(device)


def _param(src: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.detach().clone(), requires_grad=src.requires_grad)


def _finish(new: nn.Module, old: nn.Module) -> nn.Module:
    new.train(old.training)
    return new


def shrink_linear_out(linear: nn.Linear, keep: Keep) -> nn.Linear:
    """New ``nn.Linear`` with only the output rows ``keep`` (weight rows and bias)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"shrink_linear_out needs nn.Linear, got {type(linear).__name__}")
    w = linear.weight
    idx = _index(keep, linear.out_features, w.device, f"shrink_linear_out({linear})")
    new = nn.Linear(linear.in_features, idx.numel(), bias=linear.bias is not None, device="meta", dtype=w.dtype)
    new.weight = _param(w, w.index_select(0, idx))
    if linear.bias is not None:
        new.bias = _param(linear.bias, linear.bias.index_select(0, idx))
    return _finish(new, linear)


def shrink_linear_in(linear: nn.Linear, keep: Keep) -> nn.Linear:
    """New ``nn.Linear`` with only the input columns ``keep`` (bias unchanged)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"shrink_linear_in needs nn.Linear, got {type(linear).__name__}")
    w = linear.weight
    idx = _index(keep, linear.in_features, w.device, f"shrink_linear_in({linear})")
    new = nn.Linear(idx.numel(), linear.out_features, bias=linear.bias is not None, device="meta", dtype=w.dtype)
    new.weight = _param(w, w.index_select(1, idx))
    if linear.bias is not None:
        new.bias = _param(linear.bias, linear.bias)
    return _finish(new, linear)


def _check_conv(conv, what: str) -> None:
    if not isinstance(conv, _CONV_TYPES):
        raise TypeError(f"{what} needs nn.Conv1d/Conv2d/Conv3d, got {type(conv).__name__}")
    if conv.groups != 1:
        raise ValueError(f"{what}: only groups=1 convolutions can be shrunk, got {conv} (groups={conv.groups})")


def _new_conv(conv, in_ch: int, out_ch: int):
    # the plain torch class, also for a subclass (a compressed layer): the copy carries no extra state
    plain = next(c for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d) if isinstance(conv, c))
    return plain(in_ch, out_ch, kernel_size=conv.kernel_size, stride=conv.stride, padding=conv.padding,
                      dilation=conv.dilation, groups=1, bias=conv.bias is not None,
                      padding_mode=conv.padding_mode, device="meta", dtype=conv.weight.dtype)


def shrink_conv_out(conv: nn.Conv2d, keep: Keep) -> nn.Conv2d:
    """New conv with only the output channels ``keep`` (groups=1 only)."""
    _check_conv(conv, "shrink_conv_out")
    w = conv.weight
    idx = _index(keep, conv.out_channels, w.device, f"shrink_conv_out({conv})")
    new = _new_conv(conv, conv.in_channels, idx.numel())
    new.weight = _param(w, w.index_select(0, idx))
    if conv.bias is not None:
        new.bias = _param(conv.bias, conv.bias.index_select(0, idx))
    return _finish(new, conv)


def shrink_conv_in(conv: nn.Conv2d, keep: Keep) -> nn.Conv2d:
    """New conv with only the input channels ``keep`` (groups=1 only; bias unchanged)."""
    _check_conv(conv, "shrink_conv_in")
    w = conv.weight
    idx = _index(keep, conv.in_channels, w.device, f"shrink_conv_in({conv})")
    new = _new_conv(conv, idx.numel(), conv.out_channels)
    new.weight = _param(w, w.index_select(1, idx))
    if conv.bias is not None:
        new.bias = _param(conv.bias, conv.bias)
    return _finish(new, conv)


def shrink_batchnorm(bn: nn.BatchNorm2d, keep: Keep) -> nn.BatchNorm2d:
    """New BatchNorm with only the features ``keep`` (affine params and running stats;
    ``num_batches_tracked`` copied)."""
    if not isinstance(bn, _BN_TYPES):
        raise TypeError(f"shrink_batchnorm needs nn.BatchNorm1d/2d/3d, got {type(bn).__name__}")
    ref = bn.weight if bn.weight is not None else bn.running_mean
    device = ref.device if ref is not None else torch.device("cpu")
    dtype = ref.dtype if ref is not None else torch.get_default_dtype()
    idx = _index(keep, bn.num_features, device, f"shrink_batchnorm({bn})")
    new = type(bn)(idx.numel(), eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                   track_running_stats=bn.track_running_stats, device="meta", dtype=dtype)
    if bn.affine:
        new.weight = _param(bn.weight, bn.weight.index_select(0, idx))
        new.bias = _param(bn.bias, bn.bias.index_select(0, idx))
    for name in ("running_mean", "running_var"):
        buf = getattr(bn, name)
        setattr(new, name, None if buf is None else buf.detach().index_select(0, idx).clone())
    nbt = bn.num_batches_tracked
    new.num_batches_tracked = None if nbt is None else nbt.detach().clone()
    return _finish(new, bn)


def head_keep_indices(head_mask: torch.Tensor, head_dim: int) -> torch.Tensor:
    """LongTensor of the columns ``h*head_dim .. (h+1)*head_dim-1`` of every kept head ``h``."""
    head_dim = int(head_dim)
    if head_dim < 1:
        raise ValueError(f"head_keep_indices: head_dim must be >= 1, got {head_dim}")
    heads = keep_indices(torch.as_tensor(head_mask))
    offs = torch.arange(head_dim, dtype=torch.long, device=heads.device)
    return (heads[:, None] * head_dim + offs[None, :]).reshape(-1)


def _head_rows(head_mask, head_dim: int, features: int, stacked: int, what: str) -> torch.Tensor:
    head_mask = torch.as_tensor(head_mask)
    if head_mask.dim() != 1:
        raise ValueError(f"{what}: head_mask must be 1-D [num_heads], got shape {tuple(head_mask.shape)}")
    num_heads = head_mask.numel()
    stacked = int(stacked)
    if stacked < 1 or features != stacked * num_heads * int(head_dim):
        raise ValueError(f"{what}: features={features} != stacked ({stacked}) * num_heads ({num_heads}) "
                         f"* head_dim ({head_dim})")
    cols = head_keep_indices(head_mask, head_dim)
    if cols.numel() == 0:
        raise ValueError(f"{what}: head_mask prunes every head")
    chunk = num_heads * int(head_dim)
    return torch.cat([cols + k * chunk for k in range(stacked)])


def shrink_linear_heads_out(linear: nn.Linear, head_mask: torch.Tensor, head_dim: int,
                            stacked: int = 1) -> nn.Linear:
    """Remove the output rows of pruned heads from a Q/K/V projection (``stacked=3``: fused qkv,
    rows removed in each of the q|k|v chunks, chunk order kept)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"shrink_linear_heads_out needs nn.Linear, got {type(linear).__name__}")
    rows = _head_rows(head_mask, head_dim, linear.out_features, stacked, f"shrink_linear_heads_out({linear})")
    return shrink_linear_out(linear, rows)


def shrink_linear_heads_in(linear: nn.Linear, head_mask: torch.Tensor, head_dim: int) -> nn.Linear:
    """Remove the input columns of pruned heads from an attention output projection."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"shrink_linear_heads_in needs nn.Linear, got {type(linear).__name__}")
    cols = _head_rows(head_mask, head_dim, linear.in_features, 1, f"shrink_linear_heads_in({linear})")
    return shrink_linear_in(linear, cols)


def related_shrink(module: nn.Module, keep_out_of_previous: Keep) -> nn.Module:
    """Shrink the module that consumes a pruned layer's outputs: Linear -> ``shrink_linear_in``,
    Conv -> ``shrink_conv_in``, BatchNorm -> ``shrink_batchnorm``."""
    if isinstance(module, nn.Linear):
        return shrink_linear_in(module, keep_out_of_previous)
    if isinstance(module, _CONV_TYPES):
        return shrink_conv_in(module, keep_out_of_previous)
    if isinstance(module, _BN_TYPES):
        return shrink_batchnorm(module, keep_out_of_previous)
    raise TypeError(f"related_shrink: unsupported module type {type(module).__name__}; "
                    f"supported: nn.Linear, nn.Conv1d/nn.Conv2d/nn.Conv3d (groups=1), nn.BatchNorm1d/nn.BatchNorm2d/nn.BatchNorm3d")


def replace_module(root: nn.Module, dotted_name: str, new_module: nn.Module) -> nn.Module:
    """Set the submodule ``dotted_name`` of ``root`` (numeric parts index ModuleList/Sequential)
    to ``new_module``; returns the module it replaced."""
    if not dotted_name:
        raise ValueError("replace_module: dotted_name is empty (the root itself cannot be replaced)")
    if not isinstance(new_module, nn.Module):
        raise TypeError(f"replace_module: new_module must be an nn.Module, got {type(new_module).__name__}")
    parent_name, _, last = dotted_name.rpartition(".")
    try:
        parent = root.get_submodule(parent_name) if parent_name else root
    except AttributeError as e:
        raise AttributeError(f"replace_module: no submodule {parent_name!r} in {type(root).__name__} "
                             f"(while replacing {dotted_name!r}): {e}") from None
    if last not in parent._modules:
        raise AttributeError(f"replace_module: {type(parent).__name__} {parent_name or '<root>'!r} has no "
                             f"submodule {last!r} (while replacing {dotted_name!r})")
    old = parent._modules[last]
    setattr(parent, last, new_module)
    return old
