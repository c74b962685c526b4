"""The block layout as the kernels read it: CSR and CSC indexes of the nonzero blocks.

A layout is an integer tensor ``[heads, num_blocks, num_blocks]`` (what every
``SparsityConfig.make_layout(seq_len)`` returns); entry ``(h, r, c)`` nonzero means that in head
``h`` the tokens of block-row ``r`` attend to the tokens of block-column ``c``. The nonzero blocks
are numbered in ``layout.nonzero()`` order (head, then block-row, then block-column): block ``k``
of a block-sparse tensor ``[batch, nnz, block, block]`` is the tile of nonzero ``k``.
"""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["BlockLayout", "check_layout"]


def check_layout(layout, name: str = "layout") -> torch.Tensor:
    """``layout`` as a bool CPU tensor ``[heads, nb, nb]``; TypeError / ValueError naming it otherwise."""
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [heads, num_blocks, num_blocks], got {type(layout).__name__}")
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"{name} must have shape [heads, num_blocks, num_blocks], got {tuple(layout.shape)}")
    if layout.is_floating_point() or layout.is_complex():
        raise TypeError(f"{name} must be an integer or bool tensor of 0/1 entries, got {layout.dtype}")
    return layout.detach().to("cpu") != 0


class BlockLayout:
    """Index arrays of one layout and block size (int64, CPU, contiguous).

    ``heads``, ``num_blocks``, ``block``, ``nnz``; per nonzero block ``k``: ``head[k]``,
    ``row[k]``, ``col[k]``; ``row_ptr`` ([heads * nb + 1], CSR over (head, block-row));
    ``col_ptr`` ([heads * nb + 1]) with ``col_rows`` / ``col_ids`` (CSC over (head, block-col):
    entry ``e`` is block ``col_ids[e]`` at block-row ``col_rows[e]``).
    """

    def __init__(self, layout, block: int):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        mask = check_layout(layout)
        self.block = block
        self.heads, self.num_blocks = int(mask.shape[0]), int(mask.shape[1])
        self.mask = mask
        nb = self.num_blocks
        nz = mask.nonzero()  # lexicographic (h, r, c): the value order
        self.nnz = int(nz.shape[0])
        self.head, self.row, self.col = (t.contiguous() for t in nz.unbind(1))
        self.row_ptr = torch.zeros(self.heads * nb + 1, dtype=torch.int64)
        torch.cumsum(mask.sum(-1).flatten(), 0, out=self.row_ptr[1:])
        self.col_ptr = torch.zeros(self.heads * nb + 1, dtype=torch.int64)
        torch.cumsum(mask.sum(-2).flatten(), 0, out=self.col_ptr[1:])
        key = (self.head * nb + self.col) * nb + self.row
        order = torch.argsort(key)
        self.col_ids = order.contiguous()
        self.col_rows = self.row[order].contiguous()
        self.row_id = (self.head * nb + self.row).contiguous()  # (head, block-row) of each block
        self.col_id = (self.head * nb + self.col).contiguous()  # (head, block-col) of each block
        self._device_cache = {}

    @property
    def seq_len(self) -> int:
        return self.num_blocks * self.block

    def density(self) -> float:
        """Fraction of the (heads x seq x seq) score entries the layout computes."""
        total = self.heads * self.num_blocks * self.num_blocks
        return self.nnz / total if total else 0.0

    def index_pointers(self) -> Tuple[int, int, int, int, int]:
        """Raw pointers (row_ptr, cols, col_ptr, col_rows, col_ids) for the native op."""
        return (self.row_ptr.data_ptr(), self.col.data_ptr(), self.col_ptr.data_ptr(), self.col_rows.data_ptr(),
                self.col_ids.data_ptr())

    def on(self, device) -> "BlockLayout":
        """Index tensors moved to ``device`` (for the fallback on an accelerator), cached."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        if device not in self._device_cache:
            clone = object.__new__(BlockLayout)
            clone.__dict__.update(self.__dict__)
            for name in ("head", "row", "col", "row_ptr", "col_ptr", "col_ids", "col_rows", "row_id", "col_id"):
                setattr(clone, name, getattr(self, name).to(device))
            clone._device_cache = {}
            self._device_cache[device] = clone
        return self._device_cache[device]

    def dense_mask(self) -> torch.Tensor:
        """The layout expanded to a token mask ``[heads, seq, seq]`` (bool)."""
        b = self.block
        return self.mask.repeat_interleave(b, dim=1).repeat_interleave(b, dim=2)

    def __repr__(self) -> str:
        return (f"BlockLayout(heads={self.heads}, num_blocks={self.num_blocks}, block={self.block}, "
                f"nnz={self.nnz}, density={self.density():.3f})")
