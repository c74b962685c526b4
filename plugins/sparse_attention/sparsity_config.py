"""Sparsity structures: which blocks of the attention matrix each head computes.

DeepSpeed's classes and signatures (``deepspeed.ops.sparse_attention``). Each config's
``make_layout(seq_len)`` returns an int64 tensor ``[num_heads, seq_len // block, seq_len // block]``
of 0/1: entry ``(h, r, c) = 1`` means that in head ``h`` the tokens of block-row ``r`` attend to
the tokens of block-column ``c``. With ``different_layout_per_head=False`` head 0's pattern is
computed and copied to every head.

* :class:`DenseSparsityConfig` -- every block (for testing: equals full attention).
* :class:`FixedSparsityConfig` -- "Generative Modeling with Sparse Transformers" (Child et al.):
  local windows of ``num_local_blocks`` blocks, and in each window ``num_global_blocks``
  consecutive blocks that every row attends to (and that attend to every block with
  ``horizontal_global_attention``). Window ``w``'s global blocks start at
  ``num_local_blocks - (1 + h % num_different_global_patterns) * num_global_blocks`` inside the
  window, so heads can use different representatives.
* :class:`VariableSparsityConfig` -- local windows of varying sizes (``local_window_blocks``, the
  last size repeating), global blocks at given indices (or ``[start, end)`` ranges), and
  ``num_random_blocks`` random blocks per row.
* :class:`BigBirdSparsityConfig` -- "Big Bird": ``num_random_blocks`` random blocks per row, a
  sliding window of ``num_sliding_window_blocks`` blocks, and the first ``num_global_blocks``
  blocks global (rows and columns).
* :class:`BSLongformerSparsityConfig` -- block-sparse "Longformer": sliding window plus global
  blocks at given indices (rows and columns).
* :class:`LocalSlidingWindowSparsityConfig` -- a sliding window only (DeepSpeed's later addition).

``attention="unidirectional"`` (autoregressive) keeps the layout's lower triangle where the
pattern says so (fixed / variable local windows and global columns start at the diagonal; bigbird
/ bslongformer / sliding window drop every block above the diagonal); inside the diagonal
blocks, the attention kernels mask the tokens above the diagonal (:mod:`.kernels`, causal).

Random blocks come from ``random.Random(seed)`` when a ``seed`` is given (the same layout every
call), else from Python's global ``random`` state (``random.seed`` reproduces it), as DeepSpeed.
:class:`~.sparse_self_attention.SparseSelfAttention` broadcasts its layout from rank 0 so that
data-parallel ranks agree.
"""
from __future__ import annotations

import random
from typing import List, Optional, Sequence

import torch

__all__ = [
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
    "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
    "SparsityConfigError", "ATTENTION_TYPES",
]

ATTENTION_TYPES = ("bidirectional", "unidirectional")


class SparsityConfigError(ValueError):
    """A sparsity setting that cannot work; ``key`` names the argument (and config key)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SparsityConfigError(name, f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise SparsityConfigError(name, f"{name}={value} is not valid: must be >= {minimum}")
    return value


def _int_list(name: str, values, minimum: int) -> List[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise SparsityConfigError(name, f"{name} must be a list of ints, got {values!r}")
    return [_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(values)]


def _attention(value) -> str:
    if value not in ATTENTION_TYPES:
        raise SparsityConfigError("attention", f"attention={value!r} is not valid: choose 'bidirectional' or "
                                               f"'unidirectional'")
    return value


def _global_ranges(starts, ends) -> Optional[List[int]]:
    if ends is None:
        return None
    ends = _int_list("global_block_end_indices", ends, 1)
    if len(ends) != len(starts):
        raise SparsityConfigError("global_block_end_indices",
                                  f"global_block_end_indices has {len(ends)} entries but global_block_indices has "
                                  f"{len(starts)}; they pair up as [start, end) ranges")
    for i, (start, end) in enumerate(zip(starts, ends)):
        if start >= end:
            raise SparsityConfigError("global_block_end_indices",
                                      f"global block range {i} is empty: global_block_indices[{i}]={start} must be "
                                      f"smaller than global_block_end_indices[{i}]={end}")
    return ends


class SparsityConfig:
    """Base of the sparsity structures: ``num_heads``, ``block`` (tokens per block side) and
    ``different_layout_per_head``. Subclasses implement ``make_layout(seq_len)``; this class
    defines no pattern itself."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = _int("num_heads", num_heads, 1)
        self.block = _int("block", block, 1)
        if not isinstance(different_layout_per_head, bool):
            raise SparsityConfigError("different_layout_per_head",
                                      f"different_layout_per_head must be a bool, got {different_layout_per_head!r}")
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout ``[num_heads, seq_len // block, seq_len // block]`` (int64)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if seq_len % self.block:
            raise ValueError(f"seq_len={seq_len} is not a multiple of block={self.block}: sparse attention works on "
                             f"whole blocks (pad the sequence, e.g. SparseAttentionUtils.pad_to_block_size)")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's pattern to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} defines no sparsity pattern: use DenseSparsityConfig, "
                        f"FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
                        f"BSLongformerSparsityConfig or LocalSlidingWindowSparsityConfig, or subclass "
                        f"SparsityConfig and implement make_layout(seq_len)")

    @property
    def attention_type(self) -> str:
        """"unidirectional" (causal) or "bidirectional"."""
        return getattr(self, "attention", "bidirectional")

    def _rng(self):
        seed = getattr(self, "seed", None)
        return random.Random(seed) if seed is not None else random

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "num_layout_heads")
        return f"{type(self).__name__}({fields})"


class DenseSparsityConfig(SparsityConfig):
    """Every block: the layout of full attention (for tests and comparisons)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        super().__init__(num_heads, block, different_layout_per_head)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _local_windows(layout: torch.Tensor, h: int, windows, unidirectional: bool) -> None:
    """Blocks of each ``(start, end)`` window attend to each other (to themselves and earlier
    ones when unidirectional)."""
    for start, end in windows:
        if unidirectional:
            size = end - start
            layout[h, start:end, start:end] |= torch.ones(size, size, dtype=layout.dtype).tril()
        else:
            layout[h, start:end, start:end] = 1


class FixedSparsityConfig(SparsityConfig):
    """Local windows plus global representatives (Sparse Transformers' "fixed" pattern)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = _int("num_local_blocks", num_local_blocks, 1)
        self.num_global_blocks = _int("num_global_blocks", num_global_blocks, 1)
        if num_local_blocks % num_global_blocks:
            raise SparsityConfigError("num_global_blocks",
                                      f"num_local_blocks={num_local_blocks} must be a multiple of "
                                      f"num_global_blocks={num_global_blocks}")
        self.attention = _attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise SparsityConfigError("horizontal_global_attention",
                                      "horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        patterns = _int("num_different_global_patterns", num_different_global_patterns, 1)
        if patterns > 1 and not different_layout_per_head:
            raise SparsityConfigError("num_different_global_patterns",
                                      f"num_different_global_patterns={patterns} needs different_layout_per_head="
                                      f"True (with one layout for all heads there is one pattern)")
        if patterns > num_local_blocks // num_global_blocks:
            raise SparsityConfigError("num_different_global_patterns",
                                      f"num_different_global_patterns={patterns} exceeds num_local_blocks / "
                                      f"num_global_blocks = {num_local_blocks} / {num_global_blocks} = "
                                      f"{num_local_blocks // num_global_blocks} (the positions a window has)")
        self.num_different_global_patterns = patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb, w = layout.shape[1], self.num_local_blocks
        _local_windows(layout, h, [(i, min(i + w, nb)) for i in range(0, nb, w)],
                       self.attention == "unidirectional")
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb, w, g = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        offset = w - (1 + h % self.num_different_global_patterns) * g  # first global block inside a window
        full = nb - nb % w  # blocks covered by whole windows
        starts = list(range(offset, full, w))
        if full < nb:  # a short last window: its global blocks as near the offset as fit
            starts.append(min(full + offset, nb - g))
        for start in starts:
            start = max(start, 0)
            end = min(start + g, nb)
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """Variable-size local windows, global blocks at given indices, random blocks."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Optional[Sequence[int]] = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False, *,
                 seed: Optional[int] = None):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _int("num_random_blocks", num_random_blocks, 0)
        self.local_window_blocks = _int_list("local_window_blocks", local_window_blocks, 1)
        if not self.local_window_blocks:
            raise SparsityConfigError("local_window_blocks", "local_window_blocks must list at least one window size")
        self.global_block_indices = _int_list("global_block_indices", global_block_indices, 0)
        self.global_block_end_indices = _global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = _attention(attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise SparsityConfigError("horizontal_global_attention",
                                      "horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng=None) -> torch.Tensor:
        nb = layout.shape[1]
        if nb < self.num_random_blocks:
            raise SparsityConfigError("num_random_blocks",
                                      f"num_random_blocks={self.num_random_blocks} exceeds the {nb} blocks of a row "
                                      f"(seq_len {nb * self.block})")
        rng = rng or self._rng()
        for row in range(nb):
            layout[h, row, rng.sample(range(nb), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        windows, start = [], 0
        sizes = list(self.local_window_blocks)
        while start < nb:
            size = sizes.pop(0) if len(sizes) > 1 else sizes[0]  # the last size repeats
            windows.append((start, min(start + size, nb)))
            start += size
        _local_windows(layout, h, windows, self.attention == "unidirectional")
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start >= nb:
                continue  # beyond this sequence length
            end = min(end, nb)
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def _sliding_window(layout: torch.Tensor, h: int, size: int, block: int, unidirectional: bool = False) -> None:
    nb = layout.shape[1]
    if nb < size:
        raise SparsityConfigError("num_sliding_window_blocks",
                                  f"num_sliding_window_blocks={size} exceeds the {nb} blocks of a row (seq_len "
                                  f"{nb * block})")
    half = size // 2
    for row in range(nb):
        end = row + 1 if unidirectional else min(row + half + 1, nb)
        layout[h, row, max(0, row - half):end] = 1


class BigBirdSparsityConfig(SparsityConfig):
    """Random, sliding-window and global blocks (Big Bird's ITC pattern)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional", *, seed: Optional[int] = None):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = _int("num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = _int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.num_global_blocks = _int("num_global_blocks", num_global_blocks, 1)
        self.attention = _attention(attention)
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng=None) -> torch.Tensor:
        nb = layout.shape[1]
        if nb < self.num_random_blocks:
            raise SparsityConfigError("num_random_blocks",
                                      f"num_random_blocks={self.num_random_blocks} exceeds the {nb} blocks of a row "
                                      f"(seq_len {nb * self.block})")
        rng = rng or self._rng()
        for row in range(nb):
            # unidirectional: only blocks at or before the row (all of them when fewer than asked)
            choices = range(nb) if self.attention == "bidirectional" else range(row + 1)
            layout[h, row, rng.sample(choices, min(self.num_random_blocks, len(choices)))] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, self.block)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb, g = layout.shape[1], self.num_global_blocks
        if nb < g:
            raise SparsityConfigError("num_global_blocks",
                                      f"num_global_blocks={g} exceeds the {nb} blocks of a row (seq_len "
                                      f"{nb * self.block})")
        layout[h, :g, :] = 1
        layout[h, :, :g] = 1
        if self.attention == "unidirectional":
            layout[h] = layout[h].tril()
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Sliding window plus global blocks at given indices (block-sparse Longformer)."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Optional[Sequence[int]] = None, attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = _int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.global_block_indices = _int_list("global_block_indices", global_block_indices, 0)
        self.global_block_end_indices = _global_ranges(self.global_block_indices, global_block_end_indices)
        self.attention = _attention(attention)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, self.block)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        nb = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends):
            if start >= nb:
                continue
            end = min(end, nb)
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        if self.attention == "unidirectional":
            layout[h] = layout[h].tril()
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window of ``num_sliding_window_blocks`` blocks (only the current and earlier
    blocks of it when unidirectional, the default)."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = _int("num_sliding_window_blocks", num_sliding_window_blocks, 1)
        self.attention = _attention(attention)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, self.block, self.attention == "unidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)
