"""``SparseSelfAttention``: attention restricted to a sparsity config's block layout.

DeepSpeed's module and signature. The layout is built once for ``max_seq_length`` tokens (the
``master_layout`` buffer, saved with the module's state) and sliced to the first
``seq_len // block`` blocks for shorter sequences. With ``torch.distributed`` initialized, the
first forward broadcasts it from rank 0, so ranks agree on random blocks.

Forward takes ``query``, ``key``, ``value`` as ``[batch, heads, seq_len, head_dim]`` (``key`` may
come transposed, ``[batch, heads, head_dim, seq_len]``) and returns ``[batch, heads, seq_len,
head_dim]``; the scale is ``head_dim ** -0.5``. ``rpe`` (broadcastable to ``[batch, heads, seq_len,
seq_len]``) is added to the scaled scores; ``key_padding_mask`` (``[batch, seq_len]``, or a shape
that squeezes to it) and ``attn_mask`` (``[seq_len, seq_len]``) follow ``key_padding_mask_mode`` /
``attn_mask_mode``: ``"add"`` adds the values, ``"mul"`` masks where the value is 0; a bool mask
means True = attend. A config with ``attention="unidirectional"`` also masks every token's
future (causal), also inside the diagonal blocks. The computation is in :mod:`.kernels`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .kernels import MASK_MODES, block_sparse_attention
from .layout import BlockLayout
from .sparsity_config import FixedSparsityConfig, SparsityConfig

__all__ = ["SparseSelfAttention"]


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention (scaled dot product, softmax, weighted sum of values).

    ``sparsity_config``: a :class:`~.sparsity_config.SparsityConfig` subclass instance (default:
    ``FixedSparsityConfig(num_heads=4)``); ``key_padding_mask_mode`` / ``attn_mask_mode``:
    ``"add"`` or ``"mul"``; ``max_seq_length``: the longest sequence (a multiple of the block).
    ``backend``: None (native op for CPU tensors when available, else the torch fallback),
    ``"native"`` or ``"torch"``.
    """

    def __init__(self, sparsity_config: Optional[SparsityConfig] = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, *, backend: Optional[str] = None):
        super().__init__()
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=4)
        if not isinstance(sparsity_config, SparsityConfig):
            raise TypeError(f"sparsity_config must be a SparsityConfig (e.g. FixedSparsityConfig), got "
                            f"{type(sparsity_config).__name__}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name}={mode!r} is not valid; choose 'add' or 'mul'")
        if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1:
            raise ValueError(f"max_seq_length must be a positive int, got {max_seq_length!r}")
        block = sparsity_config.block
        if max_seq_length % block:
            raise ValueError(f"max_seq_length={max_seq_length} is not a multiple of the sparsity config's "
                             f"block={block}")
        if backend not in (None, "native", "torch"):
            raise ValueError(f"backend={backend!r} is not valid; choose None, 'native' or 'torch'")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.backend = backend
        layout = sparsity_config.make_layout(max_seq_length)
        if tuple(layout.shape) != (sparsity_config.num_heads, max_seq_length // block, max_seq_length // block):
            raise ValueError(f"{type(sparsity_config).__name__}.make_layout({max_seq_length}) returned shape "
                             f"{tuple(layout.shape)}; expected [num_heads, seq_len // block, seq_len // block] = "
                             f"[{sparsity_config.num_heads}, {max_seq_length // block}, {max_seq_length // block}]")
        self.register_buffer("master_layout", layout)
        self._need_layout_synchronization = True
        self._layouts: Dict[int, Tuple[tuple, BlockLayout]] = {}

    # ------------------------------------------------------------------ layout
    def _synchronize_layout(self) -> None:
        """Broadcast the layout from rank 0 once (random blocks must agree across ranks)."""
        if not self._need_layout_synchronization:
            return
        from dsplug import comm

        if comm.is_initialized() and comm.get_world_size() > 1:
            device = torch.device("cpu")
            if comm.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            shared = self.master_layout.to(device)
            comm.broadcast(shared, src=0)
            with torch.no_grad():
                self.master_layout.copy_(shared)
        self._need_layout_synchronization = False

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len`` tokens: the master layout's first ``seq_len // block`` blocks."""
        block = self.sparsity_config.block
        if seq_len % block:
            raise ValueError(f"seq_len={seq_len} is not a multiple of block={block}; pad the sequence "
                             f"(SparseAttentionUtils.pad_to_block_size)")
        if seq_len > self.max_seq_length:
            raise ValueError(f"seq_len={seq_len} exceeds max_seq_length={self.max_seq_length} the layout was built "
                             f"for; construct SparseSelfAttention with a larger max_seq_length")
        self._synchronize_layout()
        nb = seq_len // block
        return self.master_layout[..., :nb, :nb].cpu()

    def block_layout(self, seq_len: int) -> BlockLayout:
        """The kernels' index of :meth:`get_layout` (cached until the master layout changes)."""
        self._synchronize_layout()
        stamp = (self.master_layout.data_ptr(), self.master_layout._version, self.master_layout.device)
        cached = self._layouts.get(seq_len)
        if cached is None or cached[0] != stamp:
            cached = (stamp, BlockLayout(self.get_layout(seq_len), self.sparsity_config.block))
            self._layouts[seq_len] = cached
        return cached[1]

    # ------------------------------------------------------------------ forward
    @staticmethod
    def transpose_key_for_scores(x: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``key`` given as ``[batch, heads, head_dim, seq_len]`` back to ``[batch, heads, seq_len, head_dim]``."""
        if x.dim() == 4 and x.shape[-2] != seq_len and x.shape[-1] == seq_len:
            return x.transpose(-1, -2)
        return x

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe=None, key_padding_mask=None,
                attn_mask=None) -> torch.Tensor:
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            raise ValueError(f"query must be [batch, heads, seq_len, head_dim], got {shape}")
        bsz, num_heads, seq_len, head_dim = query.shape
        key = self.transpose_key_for_scores(key, seq_len)
        if key.shape != query.shape or value.shape != query.shape:
            raise ValueError(f"query, key and value must have the same shape (self-attention): got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if num_heads != self.sparsity_config.num_heads:
            raise ValueError(f"query has {num_heads} heads but the sparsity config has num_heads="
                             f"{self.sparsity_config.num_heads}")
        layout = self.block_layout(seq_len)
        return block_sparse_attention(
            query, key, value, layout, scale=float(head_dim) ** -0.5, rpe=rpe, key_padding_mask=key_padding_mask,
            attn_mask=attn_mask, key_padding_mask_mode=self.key_padding_mask_mode,
            attn_mask_mode=self.attn_mask_mode, causal=self.sparsity_config.attention_type == "unidirectional",
            backend=self.backend)

    def extra_repr(self) -> str:
        return (f"{self.sparsity_config!r}, key_padding_mask_mode={self.key_padding_mask_mode!r}, "
                f"attn_mask_mode={self.attn_mask_mode!r}, max_seq_length={self.max_seq_length}")
