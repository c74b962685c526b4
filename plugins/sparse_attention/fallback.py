"""The pure-torch block-sparse kernels: gather the nonzero blocks, batched matmuls, scatter-add.

The same operations as the native ``sparse_attn`` op (csrc/sparse_attention/sparse_attention.h has
the contract) on tensors of any device and floating dtype; used when the native op is not
available, for tensors off the CPU, and in tests as the reference the native op is proven equal
to. Dense operands are ``[B, H, S, D]``, block-sparse ones ``[B, nnz, block, block]`` in the
layout's nonzero order (:class:`~.layout.BlockLayout`).

Gathered operands take ``nnz * block * D`` floats per batch; the work is cut into chunks of
nonzero blocks so that a chunk's gathers stay under :data:`CHUNK_BYTES`.
"""
from __future__ import annotations

from typing import Iterator

import torch

from .layout import BlockLayout

CHUNK_BYTES = 64 << 20

__all__ = ["sdd", "dsd", "dsd_t", "softmax_forward", "softmax_backward", "CHUNK_BYTES"]


def _chunks(L: BlockLayout, batch: int, width: int, itemsize: int) -> Iterator[slice]:
    per_block = max(1, batch * L.block * max(width, L.block) * itemsize * 3)
    step = max(1, CHUNK_BYTES // per_block)
    for start in range(0, L.nnz, step):
        yield slice(start, min(L.nnz, start + step))


def _blocks(x: torch.Tensor, L: BlockLayout) -> torch.Tensor:
    """``[B, H, S, D]`` viewed as ``[B, H * nb, block, D]``."""
    B, H, S, D = x.shape
    return x.reshape(B, H * L.num_blocks, L.block, D)


def sdd(L: BlockLayout, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out[:, k] = a_(h,r) @ b_(h,c)^T`` for each nonzero block ``k = (h, r, c)``."""
    Lx = L.on(a.device)
    B = a.shape[0]
    ab, bb = _blocks(a, L), _blocks(b, L)
    out = a.new_empty((B, L.nnz, L.block, L.block))
    for s in _chunks(L, B, a.shape[-1], a.element_size()):
        out[:, s] = torch.matmul(ab[:, Lx.row_id[s]], bb[:, Lx.col_id[s]].transpose(-1, -2))
    return out


def _spmm(L: BlockLayout, vals: torch.Tensor, b: torch.Tensor, alpha: float, transposed: bool) -> torch.Tensor:
    Lx = L.on(b.device)
    B, H, S, D = b.shape
    bb = _blocks(b, L)
    out = b.new_zeros((B, H * L.num_blocks, L.block, D))
    gather, scatter = (Lx.row_id, Lx.col_id) if transposed else (Lx.col_id, Lx.row_id)
    for s in _chunks(L, B, D, b.element_size()):
        tiles = vals[:, s].transpose(-1, -2) if transposed else vals[:, s]
        out.index_add_(1, scatter[s], torch.matmul(tiles, bb[:, gather[s]]))
    if alpha != 1.0:
        out.mul_(alpha)
    return out.reshape(B, H, S, D)


def dsd(L: BlockLayout, vals: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out_(h,r) = alpha * sum_k vals[:, k] @ b_(h,c)`` over the blocks of each block-row."""
    return _spmm(L, vals, b, alpha, transposed=False)


def dsd_t(L: BlockLayout, vals: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out_(h,c) = alpha * sum_k vals[:, k]^T @ b_(h,r)`` over the blocks of each block-column."""
    return _spmm(L, vals, b, alpha, transposed=True)


def _row_ids(L: BlockLayout, device) -> torch.Tensor:
    """``[nnz, block]``: the token row (over all heads) each tile row belongs to."""
    Lx = L.on(device)
    return Lx.row_id[:, None] * L.block + torch.arange(L.block, device=device)


def _row_reduce(values: torch.Tensor, rid: torch.Tensor, rows: int, how: str) -> torch.Tensor:
    """Reduce ``values [B, nnz, block]`` (one number per tile row) over each token row."""
    B = values.shape[0]
    flat_ids = rid.reshape(1, -1).expand(B, -1)
    flat = values.reshape(B, -1)
    if how == "amax":
        init = torch.full((B, rows), float("-inf"), dtype=values.dtype, device=values.device)
        return init.scatter_reduce_(1, flat_ids, flat, "amax", include_self=True)
    return torch.zeros((B, rows), dtype=values.dtype, device=values.device).index_add_(1, rid.reshape(-1), flat)


def masked_scores(L: BlockLayout, x: torch.Tensor, terms) -> torch.Tensor:
    """``scale * x + rpe + key_padding + attn_mask`` on the tiles, -inf above the diagonal when
    causal (``terms``: :class:`~.kernels.SoftmaxTerms`)."""
    Lx = L.on(x.device)
    nb, blk = L.num_blocks, L.block
    out = x * terms.scale
    if terms.rpe is not None:
        rpe = terms.rpe  # [Br, Hr, S, S], Br in (1, B), Hr in (1, H)
        Br, Hr = rpe.shape[:2]
        heads = Lx.head if Hr > 1 else torch.zeros_like(Lx.head)
        tiles = rpe.reshape(Br, Hr, nb, blk, nb, blk)[:, heads, Lx.row, :, Lx.col, :]  # [nnz, Br, blk, blk]
        out = out + tiles.permute(1, 0, 2, 3)
    if terms.key_padding is not None:
        kp = terms.key_padding  # [Bk, S]
        out = out + kp.reshape(kp.shape[0], nb, blk)[:, Lx.col].unsqueeze(2)
    if terms.attn_mask is not None:
        out = out + terms.attn_mask.reshape(nb, blk, nb, blk)[Lx.row, :, Lx.col, :]
    if terms.causal:
        above = torch.ones(blk, blk, dtype=torch.bool, device=x.device).triu(1)
        masked = (Lx.col > Lx.row)[:, None, None] | ((Lx.col == Lx.row)[:, None, None] & above)
        out = out.masked_fill(masked, float("-inf"))
    return out


def softmax_forward(L: BlockLayout, x: torch.Tensor, terms) -> torch.Tensor:
    """Softmax of the masked scores along each token row over the row's nonzero blocks; a row
    with no finite entry becomes all zeros."""
    z = masked_scores(L, x, terms)
    rid = _row_ids(L, x.device)
    rows = L.heads * L.seq_len
    row_max = _row_reduce(z.amax(-1), rid, rows, "amax")[:, rid]  # [B, nnz, blk]
    row_max = torch.where(row_max > float("-inf"), row_max, torch.zeros_like(row_max))
    e = torch.exp(z - row_max.unsqueeze(-1))
    total = _row_reduce(e.sum(-1), rid, rows, "sum")[:, rid]
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    return e * inv.unsqueeze(-1)


def softmax_backward(L: BlockLayout, prob: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``prob * (grad - rowsum(prob * grad))``: the gradient w.r.t. the masked scores."""
    rid = _row_ids(L, prob.device)
    dot = _row_reduce((prob * grad).sum(-1), rid, L.heads * L.seq_len, "sum")[:, rid]
    return prob * (grad - dot.unsqueeze(-1))
