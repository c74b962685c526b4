"""Pruning masks for ``compression_training`` (pure tensor functions, no config, no engine).

Every mask is a float tensor of ``0.`` / ``1.`` on the device of the tensor it was computed
from, dtype ``float32`` unless stated (:class:`TopKBinarizer` returns the scores' dtype).
Scores are never modified in place; masks are computed without autograd (except through
:class:`TopKBinarizer`, whose gradient is the straight-through estimator).

Formulas (``r`` = dense ratio, the fraction of entries KEPT; ``n`` = number of candidates):

``kept_count(n, r)``
    ``k = clamp(int(round(r * n)), 1, n)``, ``r`` in ``(0, 1]``.

``topk_mask(s, r)``
    ``mask = 1`` at the ``k = kept_count(s.numel(), r)`` largest entries of ``s.flatten()``
    (ties broken in ``torch.topk``'s order), ``0`` elsewhere; ``mask.shape == s.shape``.

``sparse_l1_mask(W, r)``
    ``topk_mask(|W|, r)``: element-wise magnitude pruning, ``mask.shape == W.shape``.

``row_l1_mask(W, r)`` / ``channel_l1_mask(W, r)``
    ``score[o] = sum_{i,...} |W[o, i, ...]|`` (L1 norm of output row / output channel ``o``),
    ``mask = topk_mask(score, r)``, shape ``[out]``.

``head_scores_l1(W, H)``
    For an attention output projection ``W [out, in]`` with ``in = H * d``:
    ``score[h] = sum_{o} sum_{j = h*d}^{(h+1)*d - 1} |W[o, j]|``, shape ``[H]``.

``TopKBinarizer.apply(s, r)``
    forward ``topk_mask(s, r)`` (in ``s.dtype``); backward ``dL/ds = dL/dmask`` (STE).

Block patterns (``block_pattern``), on ``W`` viewed as 2-D ``[out, in * kh * kw]``:

``"NxM"``
    blocks of ``N`` consecutive rows x ``M`` consecutive columns;
    ``block_score[a, b] = sum_{o=aN}^{aN+N-1} sum_{i=bM}^{bM+M-1} s[o, i]``. Requires
    ``out % N == 0`` and ``in % M == 0``. Whole blocks are kept or pruned.
``"N:M"``
    along the input dim, in every group ``s[o, gM : gM+M]`` the ``N`` largest scores are kept
    (NVIDIA's 2:4 = 2 kept of every 4). Requires ``in % M == 0`` and ``1 <= N <= M``.

``snip_momentum_scores(prev, W, G, beta)``
    ``s = |W * G|`` if ``prev is None`` else ``beta * prev + (1 - beta) * |W * G|``.

``block_mask({name: s}, pattern, p)``
    ``"NxM"``: GLOBAL over all given tensors: of the ``T`` blocks of all tensors together,
    the ``int(round(p * T))`` with the lowest block scores are pruned (ties: the earlier block
    in (dict order, row-major block order) is pruned first); block masks are expanded back to
    each tensor's shape. ``"N:M"``: the local N:M mask when ``p > 0``, all ones when ``p == 0``.
    ``p`` in ``[0, 1)``.

``cubic_sparsity(step, start, end, stride, s_f)`` (Zhu & Gupta 2017)
    ``0`` if ``step < start``; ``s_f`` if ``step >= end``; otherwise with
    ``t = start + floor((step - start) / stride) * stride``:
    ``s_f * (1 - (1 - (t - start) / (end - start)) ** 3)``.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from .block_pattern import BlockPattern, parse_block_pattern

__all__ = [
    "kept_count", "topk_mask", "sparse_l1_mask", "row_l1_mask", "channel_l1_mask",
    "head_scores_l1", "head_l1_mask", "TopKBinarizer", "topk_binarize", "BlockPattern",
    "parse_block_pattern", "block_scores", "nm_mask", "snip_momentum_scores", "block_mask",
    "cubic_sparsity",
]

def _check_ratio(dense_ratio) -> float:
    if isinstance(dense_ratio, bool):
        raise ValueError(f"dense_ratio must be a number in (0, 1], got {dense_ratio!r}")
    try:
        r = float(dense_ratio)
    except (TypeError, ValueError):
        raise ValueError(f"dense_ratio must be a number in (0, 1], got {dense_ratio!r}") from None
    if not (0.0 < r <= 1.0):  # also rejects nan
        raise ValueError(f"dense_ratio must be in (0, 1], got {dense_ratio!r}")
    return r


def kept_count(n: int, dense_ratio: float) -> int:
    """Number of entries kept out of ``n``: ``clamp(int(round(dense_ratio * n)), 1, n)``."""
    r = _check_ratio(dense_ratio)
    n = int(n)
    if n < 1:
        raise ValueError(f"kept_count needs n >= 1 candidates, got n={n}")
    return min(max(int(round(r * n)), 1), n)


@torch.no_grad()
def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """float32 mask of ``scores.shape``: 1 at the ``kept_count(numel)`` largest scores."""
    flat = scores.detach().reshape(-1)
    k = kept_count(flat.numel(), dense_ratio)
    mask = torch.zeros(flat.numel(), dtype=torch.float32, device=scores.device)
    if k == flat.numel():
        mask.fill_(1.0)
    else:
        idx = torch.topk(flat, k, largest=True, sorted=False).indices
        mask[idx] = 1.0
    return mask.reshape(scores.shape)


def sparse_l1_mask(weight: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """Element-wise magnitude pruning: ``topk_mask(|weight|, dense_ratio)``, shape ``weight.shape``."""
    return topk_mask(weight.detach().abs(), dense_ratio)


def _row_l1(weight: torch.Tensor, what: str) -> torch.Tensor:
    if weight.dim() < 2:
        raise ValueError(f"{what} needs a weight with >= 2 dims [out, in, ...], got shape {tuple(weight.shape)}")
    return weight.detach().abs().float().reshape(weight.shape[0], -1).sum(dim=1)


def row_l1_mask(weight: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """Mask ``[out]`` keeping the output rows (dim 0) with the largest L1 norms."""
    return topk_mask(_row_l1(weight, "row_l1_mask"), dense_ratio)


def channel_l1_mask(weight: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """Mask ``[out_channels]`` keeping the conv output channels with the largest L1 norms."""
    return topk_mask(_row_l1(weight, "channel_l1_mask"), dense_ratio)


@torch.no_grad()
def head_scores_l1(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """float32 ``[num_heads]``: L1 norm of each head's input-column block of an output projection."""
    if weight.dim() != 2:
        raise ValueError(f"head_scores_l1 needs a 2-D output-projection weight [out, in], got shape {tuple(weight.shape)}")
    num_heads = int(num_heads)
    in_features = weight.shape[1]
    if num_heads < 1 or in_features % num_heads != 0:
        raise ValueError(f"head_scores_l1: in_features={in_features} is not divisible by num_heads={num_heads}")
    return weight.detach().abs().float().reshape(weight.shape[0], num_heads, -1).sum(dim=(0, 2))


def head_l1_mask(weight: torch.Tensor, num_heads: int, dense_ratio: float) -> torch.Tensor:
    """Mask ``[num_heads]`` keeping the heads with the largest ``head_scores_l1``."""
    return topk_mask(head_scores_l1(weight, num_heads), dense_ratio)


class TopKBinarizer(torch.autograd.Function):
    """``forward(scores, dense_ratio) = topk_mask(scores, dense_ratio)`` in ``scores.dtype``;
    ``backward`` passes the gradient straight through to ``scores`` (STE), ``None`` for the ratio.
    DeepSpeed's learnable "topk" method: ``scores`` are trainable parameters."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:  # noqa: D401
        return topk_mask(scores, dense_ratio).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None


def topk_binarize(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """``TopKBinarizer.apply(scores, dense_ratio)``."""
    return TopKBinarizer.apply(scores, dense_ratio)


def _as_2d(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() < 2:
        raise ValueError(f"{what}: block patterns need a weight with >= 2 dims [out, in, ...], got shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], -1)


def _check_divisible(shape, pattern: BlockPattern, rows: int, cols: int) -> None:
    if pattern.kind == "NxM":
        ok = rows % pattern.n == 0 and cols % pattern.m == 0
        need = f"out % {pattern.n} == 0 and in % {pattern.m} == 0"
    else:
        ok = cols % pattern.m == 0
        need = f"in % {pattern.m} == 0"
    if not ok:
        raise ValueError(f"weight shape {tuple(shape)} (viewed as [{rows}, {cols}]) does not fit "
                         f"block_pattern '{pattern}': needs {need}")


@torch.no_grad()
def block_scores(scores: torch.Tensor, pattern) -> torch.Tensor:
    """For an ``"NxM"`` pattern: ``[out/N, in/M]`` sums of element scores per block (float32)."""
    p = parse_block_pattern(pattern)
    if p.kind != "NxM":
        raise ValueError(f"block_scores needs an 'NxM' pattern, got '{p}'")
    s2 = _as_2d(scores.detach(), "block_scores").float()
    rows, cols = s2.shape
    _check_divisible(scores.shape, p, rows, cols)
    return s2.reshape(rows // p.n, p.n, cols // p.m, p.m).sum(dim=(1, 3))


@torch.no_grad()
def nm_mask(scores: torch.Tensor, pattern) -> torch.Tensor:
    """``"N:M"`` mask of ``scores.shape``: the N largest of every M consecutive inputs kept."""
    p = parse_block_pattern(pattern)
    if p.kind != "N:M":
        raise ValueError(f"nm_mask needs an 'N:M' pattern, got '{p}'")
    s2 = _as_2d(scores.detach(), "nm_mask")
    rows, cols = s2.shape
    _check_divisible(scores.shape, p, rows, cols)
    groups = s2.reshape(rows, cols // p.m, p.m)
    mask = torch.zeros(groups.shape, dtype=torch.float32, device=scores.device)
    idx = torch.topk(groups, p.n, dim=-1, largest=True, sorted=False).indices
    mask.scatter_(-1, idx, 1.0)
    return mask.reshape(scores.shape)


@torch.no_grad()
def snip_momentum_scores(previous: Optional[torch.Tensor], weight: torch.Tensor,
                         grad: torch.Tensor, beta: float = 0.9) -> torch.Tensor:
    """SNIP-momentum: ``|w*g|`` if ``previous is None`` else ``beta*previous + (1-beta)*|w*g|`` (float32)."""
    if grad is None:
        raise ValueError("snip_momentum_scores needs the weight's gradient, got grad=None")
    if grad.shape != weight.shape:
        raise ValueError(f"snip_momentum_scores: grad shape {tuple(grad.shape)} != weight shape {tuple(weight.shape)}")
    beta = float(beta)
    if not (0.0 <= beta <= 1.0):
        raise ValueError(f"snip_momentum_scores: beta must be in [0, 1], got {beta!r}")
    cur = (weight.detach().float() * grad.detach().float()).abs()
    if previous is None:
        return cur
    if previous.shape != weight.shape:
        raise ValueError(f"snip_momentum_scores: previous shape {tuple(previous.shape)} != weight shape {tuple(weight.shape)}")
    return beta * previous.detach().to(device=cur.device, dtype=torch.float32) + (1.0 - beta) * cur


@torch.no_grad()
def block_mask(scores_by_name: Mapping[str, torch.Tensor], pattern, sparsity: float) -> Dict[str, torch.Tensor]:
    """Element masks ``{name: mask}`` for a block pattern: global lowest-block pruning for
    ``"NxM"`` (``int(round(sparsity * total_blocks))`` blocks removed), local N:M for ``"N:M"``."""
    p = parse_block_pattern(pattern)
    sp = float(sparsity)
    if not (0.0 <= sp < 1.0):
        raise ValueError(f"block_mask: sparsity must be in [0, 1), got {sparsity!r}")
    names = list(scores_by_name)
    if not names:
        return {}
    if p.kind == "N:M":
        out = {}
        for name in names:
            s = scores_by_name[name]
            if sp > 0:
                out[name] = nm_mask(s, p)
            else:
                s2 = _as_2d(s, f"block_mask[{name!r}]")
                _check_divisible(s.shape, p, *s2.shape)
                out[name] = torch.ones(s.shape, dtype=torch.float32, device=s.device)
        return out
    blocks = {name: block_scores(scores_by_name[name], p) for name in names}
    dev = blocks[names[0]].device
    flat = torch.cat([blocks[name].reshape(-1).to(dev) for name in names])
    total = flat.numel()
    n_prune = int(round(sp * total))
    keep = torch.ones(total, dtype=torch.float32, device=dev)
    if n_prune > 0:
        order = torch.argsort(flat, stable=True)  # ascending; ties: earlier block first
        keep[order[:n_prune]] = 0.0
    out, off = {}, 0
    for name in names:
        s = scores_by_name[name]
        b = blocks[name]
        kb = keep[off:off + b.numel()].reshape(b.shape).to(s.device)
        off += b.numel()
        elem = kb.repeat_interleave(p.n, dim=0).repeat_interleave(p.m, dim=1)
        out[name] = elem.reshape(s.shape)
    return out


def cubic_sparsity(step: int, start: int, end: int, stride: int, final_sparsity: float) -> float:
    """Zhu & Gupta (2017) cubic schedule, piecewise constant on ``stride``-step plateaus."""
    step, start, end, stride = int(step), int(start), int(end), int(stride)
    if end <= start:
        raise ValueError(f"cubic_sparsity: end ({end}) must be > start ({start})")
    if stride < 1:
        raise ValueError(f"cubic_sparsity: stride must be >= 1, got {stride}")
    final = float(final_sparsity)
    if step < start:
        return 0.0
    if step >= end:
        return final
    t = start + ((step - start) // stride) * stride
    return final * (1.0 - (1.0 - (t - start) / (end - start)) ** 3)
