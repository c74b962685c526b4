"""Block-sparse attention: the native ``sparse_attn`` op or its pure-torch fallback, and the
autograd function :func:`block_sparse_attention` that :class:`~.sparse_self_attention.SparseSelfAttention`
runs.

Computation, for each batch ``b`` and head ``h`` with layout ``L[h]`` (``[nb, nb]``, blocks of
``block`` tokens), scale ``s`` (default ``head_dim ** -0.5``)::

    x[i, j] = s * q[i] . k[j] + rpe[i, j] + key_padding[j] + attn_mask[i, j]
              (only where L[h][i // block, j // block] != 0; -inf elsewhere,
               and -inf where j > i when causal)
    p[i, :] = softmax(x[i, :])          (a row with no finite entry: all zeros)
    out[i]  = sum_j p[i, j] v[j]

Masks: ``key_padding_mask`` ``[B, S]`` (any shape that squeezes to it, e.g. ``[B, 1, 1, S]``)
and ``attn_mask`` ``[S, S]``; mode ``"add"`` adds the values, ``"mul"`` turns 0 into -inf and
anything else into 0 (DeepSpeed's two modes); a bool mask means True = attend in either mode.
``rpe`` broadcasts to ``[B, H, S, S]`` and may require grad; it may live on another device than
the inputs (it is read on theirs; its gradient returns on its own). A layout with no nonzero
block gives zeros (output and gradients) on both backends.

Backends. CPU tensors of dtype float32 / bfloat16 / float16 run the native op in float32 (the
result is cast back); float64, tensors on other devices, or ``backend="torch"`` run the torch
fallback (:mod:`.fallback`) in the input dtype (float32 for half types). Both compute the same
quantities; tests prove them equal within float32 rounding. ``DSPLUG_DISABLE_NATIVE_OPS=1`` or a
machine without a compiler gives the fallback with one warning.

Memory. The native path works like flash attention: the forward keeps only the inputs and one
log-sum-exp per query row, and the backward recomputes each probability tile from them (one
block-row, or block-column, of tiles per thread at a time), so no ``B * nnz * block**2`` buffer
exists; this costs three more block products per tile in backward (nine in all, against six when
the probabilities are stored) and saves the memory traffic and page faults of those buffers. The
fallback stores the probabilities (``B * nnz * block**2`` values), as DeepSpeed's kernels do, and
its backward needs one more buffer of that size. A relative position embedding that requires
grad also gets a dense ``[B, H, S, S]`` gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

import torch

from dsplug.op_builder import LazyNativeOp, OpUnavailableError
from dsplug.op_builder.sparse_attn import SparseAttnBuilder
from dsplug.ops.native.handle import thread_count

from . import fallback as fb
from .layout import BlockLayout

__all__ = [
    "SoftmaxTerms", "prepare_terms", "block_sparse_attention", "sdd_matmul", "dsd_matmul", "sparse_softmax",
    "sparse_softmax_backward", "native_available", "backend", "MASK_MODES",
]

MASK_MODES = ("add", "mul")
_BACKENDS = (None, "native", "torch")
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# --------------------------------------------------------------------------- native dispatch
_NATIVE = LazyNativeOp(SparseAttnBuilder)


def _native_or_none():
    """The native extension when it is built and enabled, else None (the builder warns once)."""
    return _NATIVE.native()


def native_available() -> bool:
    """Whether CPU tensors run the native op (builds it on first call)."""
    return _native_or_none() is not None


def backend() -> str:
    """``"native (<isa>)"`` or ``"torch fallback"``."""
    native = _native_or_none()
    return f"native ({native.simd_isa()})" if native is not None else "torch fallback"


def _select(tensors, choice: Optional[str]):
    """(native extension or None, compute dtype) for these operands."""
    if choice not in _BACKENDS:
        raise ValueError(f"backend={choice!r} is not valid; choose None (automatic), 'native' or 'torch'")
    dtype = tensors[0].dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    if choice == "torch":
        return None, compute
    usable = all(t.device.type == "cpu" for t in tensors) and dtype in _NATIVE_DTYPES
    if choice == "native":
        if not usable:
            raise ValueError(f"backend='native' needs CPU tensors of dtype float32, bfloat16 or float16; got "
                             f"{dtype} on {tensors[0].device}")
        native = _native_or_none()
        if native is None:
            SparseAttnBuilder().load(fallback=False)  # raises with the reason
            raise OpUnavailableError("native op 'sparse_attn' is not available")  # pragma: no cover
        return native, compute
    return (_native_or_none() if usable else None), compute


# --------------------------------------------------------------------------- masks
@dataclass(frozen=True)
class SoftmaxTerms:
    """What the softmax adds to the scaled scores, normalized for the kernels: ``rpe``
    ``[Br, Hr, S, S]`` (Br in {1, B}, Hr in {1, H}), ``key_padding`` ``[Bk, S]`` and
    ``attn_mask`` ``[S, S]`` additive, all contiguous in the compute dtype."""

    scale: float
    rpe: Optional[torch.Tensor] = None
    key_padding: Optional[torch.Tensor] = None
    attn_mask: Optional[torch.Tensor] = None
    causal: bool = False


def _additive(mask: torch.Tensor, mode: str, name: str, dtype) -> torch.Tensor:
    if mode not in MASK_MODES:
        raise ValueError(f"{name}_mode={mode!r} is not valid; choose 'add' or 'mul'")
    if mask.dtype == torch.bool:
        keep = mask
    elif mode == "mul":
        keep = mask != 0
    else:
        return mask.to(dtype).contiguous()
    zeros = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(keep, zeros, torch.full((), float("-inf"), dtype=dtype, device=mask.device)).contiguous()


def _squeezed(mask: torch.Tensor, keep_first: bool) -> torch.Tensor:
    """DeepSpeed's squeeze: size-1 dimensions go (the batch dimension of a key padding mask stays)."""
    if keep_first:
        for d in range(mask.dim() - 1, 0, -1):
            mask = mask.squeeze(d)
        return mask
    return mask.squeeze()


def prepare_terms(shape: Tuple[int, int, int], dtype, device, *, scale: float, rpe=None, key_padding_mask=None,
                  attn_mask=None, key_padding_mask_mode: str = "add", attn_mask_mode: str = "mul",
                  causal: bool = False) -> SoftmaxTerms:
    """Check and normalize the softmax's terms for a ``(B, H, S)`` problem (errors name the
    argument and the expected shape)."""
    B, H, S = shape
    kp = am = r = None
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a tensor, got {type(key_padding_mask).__name__}")
        m = _squeezed(key_padding_mask, keep_first=True)
        if m.dim() == 1:
            m = m.unsqueeze(0)
        if m.dim() != 2 or m.shape[1] != S or m.shape[0] not in (1, B):
            raise ValueError(f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected [batch={B}, "
                             f"seq_len={S}] (or a shape that squeezes to it, e.g. [{B}, 1, 1, {S}])")
        kp = _additive(m.to(device), key_padding_mask_mode, "key_padding_mask", dtype)
    elif key_padding_mask_mode not in MASK_MODES:
        raise ValueError(f"key_padding_mask_mode={key_padding_mask_mode!r} is not valid; choose 'add' or 'mul'")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        m = _squeezed(attn_mask, keep_first=False)
        if tuple(m.shape) != (S, S):
            raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}; expected [seq_len, seq_len] = "
                             f"[{S}, {S}] (shared by every batch and head)")
        am = _additive(m.to(device), attn_mask_mode, "attn_mask", dtype)
    elif attn_mask_mode not in MASK_MODES:
        raise ValueError(f"attn_mask_mode={attn_mask_mode!r} is not valid; choose 'add' or 'mul'")
    if rpe is not None:
        r = normalize_rpe(rpe, B, H, S).to(device=device, dtype=dtype).contiguous()
    return SoftmaxTerms(scale=float(scale), rpe=r, key_padding=kp, attn_mask=am, causal=bool(causal))


def normalize_rpe(rpe, B: int, H: int, S: int) -> torch.Tensor:
    """``rpe`` as a 4-D view ``[Br, Hr, S, S]`` with Br in {1, B}, Hr in {1, H}."""
    if not isinstance(rpe, torch.Tensor):
        raise TypeError(f"rpe must be a tensor, got {type(rpe).__name__}")
    if rpe.dim() > 4 or rpe.dim() < 2:
        raise ValueError(f"rpe has shape {tuple(rpe.shape)}; expected one that broadcasts to [batch, heads, "
                         f"seq_len, seq_len] = [{B}, {H}, {S}, {S}]")
    r = rpe.reshape((1,) * (4 - rpe.dim()) + tuple(rpe.shape))
    if tuple(r.shape[2:]) != (S, S) or r.shape[0] not in (1, B) or r.shape[1] not in (1, H):
        raise ValueError(f"rpe has shape {tuple(rpe.shape)}; expected one that broadcasts to [batch, heads, "
                         f"seq_len, seq_len] = [{B}, {H}, {S}, {S}]")
    return r


# --------------------------------------------------------------------------- native calls
def _geom(L: BlockLayout, B: int, D: int):
    return [B, L.heads, L.seq_len, D, L.block, L.num_blocks, L.nnz]


def _native_terms(t: SoftmaxTerms, S: int):
    rpe_ptr = rpe_sb = rpe_sh = 0
    if t.rpe is not None:
        Br, Hr = t.rpe.shape[:2]
        rpe_ptr, rpe_sb, rpe_sh = t.rpe.data_ptr(), (Hr * S * S if Br > 1 else 0), (S * S if Hr > 1 else 0)
    kp_ptr = kp_sb = 0
    if t.key_padding is not None:
        kp_ptr, kp_sb = t.key_padding.data_ptr(), (S if t.key_padding.shape[0] > 1 else 0)
    am_ptr = t.attn_mask.data_ptr() if t.attn_mask is not None else 0
    return (float(t.scale), rpe_ptr, rpe_sb, rpe_sh, kp_ptr, kp_sb, am_ptr, bool(t.causal))


def _f32(*tensors):
    return [t.to(torch.float32).contiguous() for t in tensors]


# --------------------------------------------------------------------------- checks
def _as_layout(layout, block) -> BlockLayout:
    if isinstance(layout, BlockLayout):
        if block is not None and block != layout.block:
            raise ValueError(f"block={block} differs from the BlockLayout's block={layout.block}")
        return layout
    if block is None:
        raise ValueError("block is required when layout is a tensor")
    return BlockLayout(layout, block)


def _check_dense(name: str, x, L: BlockLayout) -> Tuple[int, int, int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [batch, heads, seq_len, head_dim], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape [batch, heads, seq_len, head_dim], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    B, H, S, D = x.shape
    if S % L.block:
        raise ValueError(f"{name} has seq_len={S}, which is not a multiple of block={L.block}; pad it "
                         f"(SparseAttentionUtils.pad_to_block_size)")
    if H != L.heads or S != L.seq_len:
        raise ValueError(f"{name} has {H} heads and seq_len {S}, but the layout is for {L.heads} heads and seq_len "
                         f"{L.seq_len} ({L.num_blocks} blocks of {L.block})")
    return B, H, S, D


def _check_sparse(name: str, x, L: BlockLayout) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != (L.nnz, L.block, L.block):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape [batch, nnz={L.nnz}, block={L.block}, block={L.block}], got {shape}")
    return x.shape[0]


# --------------------------------------------------------------------------- primitives
def sdd_matmul(a: torch.Tensor, b: torch.Tensor, layout, block: Optional[int] = None, *,
               backend: Optional[str] = None) -> torch.Tensor:
    """SDDMM: ``out[:, k] = a_(h,r) @ b_(h,c)^T`` for each nonzero block ``k = (h, r, c)``:
    ``[B, H, S, D] x [B, H, S, D] -> [B, nnz, block, block]``."""
    L = _as_layout(layout, block)
    B, H, S, D = _check_dense("a", a, L)
    if b.shape != a.shape:
        raise ValueError(f"b has shape {tuple(b.shape)}; expected a's shape {tuple(a.shape)}")
    native, compute = _select([a, b], backend)
    if native is None:
        return fb.sdd(L, a.to(compute), b.to(compute)).to(a.dtype)
    a32, b32 = _f32(a, b)
    out = torch.empty((B, L.nnz, L.block, L.block), dtype=torch.float32)
    native.sdd(_geom(L, B, D), list(L.index_pointers()), a32.data_ptr(), b32.data_ptr(), out.data_ptr(),
               thread_count(None))
    return out.to(a.dtype)


def dsd_matmul(vals: torch.Tensor, b: torch.Tensor, layout, block: Optional[int] = None, *, alpha: float = 1.0,
               transpose: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """SpMM: ``out_(h,r) = alpha * sum_k vals[:, k] @ b_(h,c)`` over each block-row; with
    ``transpose=True`` ``out_(h,c) = alpha * sum_k vals[:, k]^T @ b_(h,r)`` over each block-column.
    ``[B, nnz, block, block] x [B, H, S, D] -> [B, H, S, D]``."""
    L = _as_layout(layout, block)
    B, H, S, D = _check_dense("b", b, L)
    if _check_sparse("vals", vals, L) != B:
        raise ValueError(f"vals has batch {vals.shape[0]} but b has batch {B}")
    native, compute = _select([vals, b], backend)
    if native is None:
        fn = fb.dsd_t if transpose else fb.dsd
        return fn(L, vals.to(compute), b.to(compute), float(alpha)).to(b.dtype)
    v32, b32 = _f32(vals, b)
    out = torch.empty((B, H, S, D), dtype=torch.float32)
    fn = native.dsd_t if transpose else native.dsd
    fn(_geom(L, B, D), list(L.index_pointers()), v32.data_ptr(), b32.data_ptr(), out.data_ptr(), float(alpha),
       thread_count(None))
    return out.to(b.dtype)


def sparse_softmax(x: torch.Tensor, layout, block: Optional[int] = None, *, scale: float = 1.0, rpe=None,
                   key_padding_mask=None, attn_mask=None, key_padding_mask_mode: str = "add",
                   attn_mask_mode: str = "mul", causal: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """Block-sparse row softmax of ``scale * x + rpe + masks`` (``[B, nnz, block, block]``)."""
    L = _as_layout(layout, block)
    B = _check_sparse("x", x, L)
    native, compute = _select([x], backend)
    terms = prepare_terms((B, L.heads, L.seq_len), compute, x.device, scale=scale, rpe=rpe,
                          key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                          key_padding_mask_mode=key_padding_mask_mode, attn_mask_mode=attn_mask_mode, causal=causal)
    if native is None:
        return fb.softmax_forward(L, x.to(compute), terms).to(x.dtype)
    out = x.to(torch.float32).clone(memory_format=torch.contiguous_format)
    native.softmax_forward(_geom(L, B, 1), list(L.index_pointers()), _native_terms(terms, L.seq_len),
                           out.data_ptr(), thread_count(None))
    return out.to(x.dtype)


def sparse_softmax_backward(prob: torch.Tensor, grad: torch.Tensor, layout, block: Optional[int] = None, *,
                            backend: Optional[str] = None) -> torch.Tensor:
    """``prob * (grad - rowsum(prob * grad))``: the gradient of :func:`sparse_softmax` w.r.t. its
    masked, scaled scores (multiply by ``scale`` for the raw scores)."""
    L = _as_layout(layout, block)
    B = _check_sparse("prob", prob, L)
    if grad.shape != prob.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)}; expected prob's shape {tuple(prob.shape)}")
    native, compute = _select([prob, grad], backend)
    if native is None:
        return fb.softmax_backward(L, prob.to(compute), grad.to(compute)).to(prob.dtype)
    p32 = prob.to(torch.float32).contiguous()
    out = grad.to(torch.float32).clone(memory_format=torch.contiguous_format)
    native.softmax_backward(_geom(L, B, 1), list(L.index_pointers()), p32.data_ptr(), out.data_ptr(),
                            thread_count(None))
    return out.to(prob.dtype)


# --------------------------------------------------------------------------- autograd
@dataclass(frozen=True)
class _Spec:
    layout: BlockLayout
    terms: SoftmaxTerms
    native: object
    compute: torch.dtype


def _dense_grad(L: BlockLayout, grad: torch.Tensor, rpe_shape) -> torch.Tensor:
    """The block-sparse gradient scattered into a dense ``[Br, Hr, S, S]`` (zeros off the layout)."""
    B = grad.shape[0]
    nb, blk = L.num_blocks, L.block
    Lx = L.on(grad.device)
    dense = grad.new_zeros((B, L.heads, nb, blk, nb, blk))
    dense[:, Lx.head, Lx.row, :, Lx.col, :] = grad.permute(1, 0, 2, 3)
    dense = dense.reshape(B, L.heads, L.seq_len, L.seq_len)
    if rpe_shape[0] == 1:
        dense = dense.sum(0, keepdim=True)
    if rpe_shape[1] == 1:
        dense = dense.sum(1, keepdim=True)
    return dense


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rpe, spec: _Spec):
        L, c = spec.layout, spec.compute
        B, H, S, D = q.shape
        # rpe may live on another device than q/k/v: the kernels read it on the inputs' device (a
        # raw pointer for the native op), and its gradient goes back to rpe's own device
        terms = spec.terms if rpe is None else replace(
            spec.terms, rpe=rpe.detach().to(device=q.device, dtype=c).contiguous())
        if spec.native is not None:
            qc, kc, vc = _f32(q, k, v)
            out = torch.empty((B, H, S, D), dtype=torch.float32)
            lse = torch.empty((B, H, S), dtype=torch.float32)
            spec.native.attention_forward(_geom(L, B, D), list(L.index_pointers()), _native_terms(terms, S),
                                          qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(),
                                          lse.data_ptr(), 0, thread_count(None))
            ctx.save_for_backward(qc, kc, vc, lse)
        else:
            qc, kc, vc = (t.to(c) for t in (q, k, v))
            prob = fb.softmax_forward(L, fb.sdd(L, qc, kc), terms)
            out = fb.dsd(L, prob, vc)
            ctx.save_for_backward(qc, kc, vc, prob)
        ctx.terms = terms
        ctx.spec = spec
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, rpe.dtype if rpe is not None else None)
        ctx.rpe_shape = tuple(rpe.shape) if rpe is not None else None
        ctx.rpe_device = rpe.device if rpe is not None else None
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qc, kc, vc, saved = ctx.saved_tensors
        spec, terms = ctx.spec, ctx.terms
        L, scale = spec.layout, terms.scale
        B, H, S, D = qc.shape
        want_rpe_grad = ctx.needs_input_grad[3]
        if spec.native is not None:
            do = dout.to(torch.float32).contiguous()
            dq, dk, dv = (torch.empty((B, H, S, D), dtype=torch.float32) for _ in range(3))
            grad = torch.empty((B, L.nnz, L.block, L.block), dtype=torch.float32) if want_rpe_grad else None
            spec.native.attention_backward(_geom(L, B, D), list(L.index_pointers()), _native_terms(terms, S),
                                           qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), do.data_ptr(),
                                           saved.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                           grad.data_ptr() if grad is not None else 0, thread_count(None))
        else:
            prob = saved
            do = dout.to(spec.compute)
            grad = fb.softmax_backward(L, prob, fb.sdd(L, do, vc))
            dq = fb.dsd(L, grad, kc, scale)
            dk = fb.dsd_t(L, grad, qc, scale)
            dv = fb.dsd_t(L, prob, do)
        drpe = None
        if want_rpe_grad:
            drpe = _dense_grad(L, grad, ctx.rpe_shape).to(device=ctx.rpe_device, dtype=ctx.dtypes[3])
        qt, kt, vt = ctx.dtypes[:3]
        return dq.to(qt), dk.to(kt), dv.to(vt), drpe, None


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           layout: Union[BlockLayout, torch.Tensor], block: Optional[int] = None, *,
                           scale: Optional[float] = None, rpe=None, key_padding_mask=None, attn_mask=None,
                           key_padding_mask_mode: str = "add", attn_mask_mode: str = "mul", causal: bool = False,
                           backend: Optional[str] = None) -> torch.Tensor:
    """Attention restricted to the layout's nonzero blocks (see the module docstring), with
    gradients for query, key, value and rpe. ``[B, H, S, D]`` in, ``[B, H, S, D]`` out."""
    L = _as_layout(layout, block)
    B, H, S, D = _check_dense("query", query, L)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.shape != query.shape:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} has shape {shape}; expected query's shape {tuple(query.shape)} "
                             f"(self-attention)")
        if t.device != query.device or t.dtype != query.dtype:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; expected query's {query.dtype} on {query.device}")
    native, compute = _select([query, key, value], backend)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    terms = prepare_terms((B, H, S), compute, query.device, scale=scale, rpe=None,
                          key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                          key_padding_mask_mode=key_padding_mask_mode, attn_mask_mode=attn_mask_mode, causal=causal)
    rpe4 = normalize_rpe(rpe, B, H, S) if rpe is not None else None
    spec = _Spec(layout=L, terms=terms, native=native, compute=compute)
    return _BlockSparseAttention.apply(query, key, value, rpe4, spec)
