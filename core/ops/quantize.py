"""Group-wise (fake) quantization, a kernel service: the compression methods' quantize/dequantize
hot loop and ZeRO++'s quantized communication use it.

Every function computes in float32; inputs may be float32, bfloat16 or float16 and results have
the input's dtype and shape. The native ``quantizer`` op (csrc/quantizer/quantizer.cpp, built by
:class:`~dsplug.op_builder.QuantizerBuilder`) runs CPU tensors; the pure-torch fallback runs
everything else, or everything when the op cannot be built or ``DSPLUG_DISABLE_NATIVE_OPS=1``
(one :class:`~dsplug.op_builder.NativeOpsFallbackWarning`). Both perform the same float32
operations in the same order, so their results are bitwise equal (tests/plugins/compression/test_compression_quantize.py).

Contract
--------
``quantize_dequantize(x, bits, groups=1, symmetric=True, stochastic=False, generator=None)``:
x is flattened and split into ``groups`` equal contiguous groups (``x.numel() % groups == 0``).
Per group ``x_g``, in float32 (``/`` is an IEEE float32 division, no reciprocal)::

    symmetric  (2 <= bits <= 16):  qmax  = 2**(bits-1) - 1
                                   scale = max|x_g| / qmax
                                   q     = clamp(R(x / scale), -qmax, qmax)
                                   out   = q * scale
    asymmetric (1 <= bits <= 16):  L     = 2**bits - 1
                                   lo    = min(x_g),  hi = max(x_g)
                                   scale = (hi - lo) / L
                                   q     = clamp(R((x - lo) / scale), 0, L)
                                   out   = q * scale + lo        (a multiply, then an add)

``R`` is round-half-to-even (``torch.round``); with ``stochastic=True`` it is
``R(t) = floor(t + u)``, ``u = torch.rand(x.numel(), generator=generator)`` (float32, drawn in
Python before dispatch, so both backends see the same noise for the same generator state).
A group whose scale is 0 (all values equal; symmetric: all zero) is returned unchanged. A group
holding a NaN or an infinity comes out all-NaN. The result does not require grad.

``quantize_dequantize_range(x, bits, lo, hi, symmetric=True)``: static range (activation
calibration). ``lo``/``hi`` (python floats or 0-dim tensors, ``lo <= hi``; a non-finite one
makes the output non-finite) are first rounded to float32; symmetric uses
``scale = max(|lo|, |hi|) / qmax``, asymmetric uses the given ``lo``/``hi`` in the formulas
above; values outside the range clamp to it; nearest rounding. A zero scale (``lo == hi``, e.g.
an uncalibrated observer) passes values through unchanged.

``quantize_dequantize_rows(x, bits, symmetric=True)``: one group per row of ``x`` viewed as
``(-1, x.shape[-1])`` (per-token dynamic quantization).

``fake_quantize`` / ``fake_quantize_range`` / ``fake_quantize_rows``: the same forward, and a
straight-through estimator backward (the gradient w.r.t. x is the incoming gradient).

``quantize_to_int(x, bits, groups=1, symmetric=True) -> QuantizedTensor`` (bits <= 8, finite x):
the codes ``q`` (torch.int8 symmetric / torch.uint8 asymmetric, one byte per value, no sub-byte
packing) with per-group float32 ``scale`` and ``offset`` (``lo``; zeros for symmetric; a
zero-scale asymmetric group stores q = 0 and offset = its value). ``dequantize(qt)`` computes
``q * scale`` (+ ``offset`` for asymmetric) and equals ``quantize_dequantize(x, ...)`` exactly
(the one exception: a symmetric group of subnormals so small that ``max|x_g| / qmax`` underflows
to 0 is kept by quantize_dequantize but dequantizes to zeros).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dsplug.op_builder import LazyNativeOp, OpUnavailableError
from dsplug.ops.native.handle import thread_count
from dsplug.op_builder.quantizer import QuantizerBuilder

__all__ = [
    "quantize_dequantize", "quantize_dequantize_range", "quantize_dequantize_rows", "fake_quantize",
    "fake_quantize_range", "fake_quantize_rows", "QuantizedTensor", "quantize_to_int", "dequantize",
    "native_available", "backend",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
STATE_FORMAT = "dsplug.quantized_tensor/1"

# --------------------------------------------------------------------------- native dispatch
_NATIVE = LazyNativeOp(QuantizerBuilder)


def _native_or_none():
    """The native extension when it is built and enabled, else None (the builder warns once)."""
    return _NATIVE.native()


def _require_native():
    native = _native_or_none()
    if native is None:
        QuantizerBuilder().load(fallback=False)  # raises OpUnavailableError with the reason
        raise OpUnavailableError("native op 'quantizer' is not available")  # pragma: no cover
    return native


def native_available() -> bool:
    """Whether the native quantizer op is used for CPU tensors (builds it on first call)."""
    return _native_or_none() is not None


def backend() -> str:
    """"native (<isa>)" or "torch fallback"."""
    native = _native_or_none()
    return f"native ({native.simd_isa()})" if native is not None else "torch fallback"


# --------------------------------------------------------------------------- checks
def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; quantization supports float32, bfloat16 and float16")
    if x.layout != torch.strided:
        raise ValueError(f"x must be a dense tensor, got layout {x.layout}")


def _check_bits(bits, symmetric: bool, max_bits: int = 16) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {bits!r}")
    low = 2 if symmetric else 1
    if not low <= bits <= max_bits:
        kind = "symmetric" if symmetric else "asymmetric"
        raise ValueError(f"bits={bits} is out of range: {kind} quantization needs {low} <= bits <= {max_bits}")
    return bits


def _check_groups(x: torch.Tensor, groups) -> int:
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups={groups} must be >= 1")
    n = x.numel()
    if n % groups:
        raise ValueError(f"x has numel={n} elements (shape {tuple(x.shape)}), which do not split into "
                         f"groups={groups} equal groups")
    return groups


def _levels(bits: int, symmetric: bool) -> Tuple[int, int]:
    """(smallest, largest) code."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        return -qmax, qmax
    return 0, 2 ** bits - 1


def _flat32(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous 1-D float32 tensor (x itself when it already is one)."""
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _noise(n: int, generator, device) -> torch.Tensor:
    return torch.rand(n, generator=generator, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------- the two backends
def _torch_scales(xg: torch.Tensor, bits: int, symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row (group) scale and offset of xg [groups, size], float32."""
    _, top = _levels(bits, symmetric)
    if symmetric:
        scale = xg.abs().amax(dim=1) / top
        return scale, torch.zeros_like(scale)
    lo = xg.amin(dim=1)
    hi = xg.amax(dim=1)
    return (hi - lo) / top, lo


def _torch_apply(xg: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, symmetric: bool,
                 noise: Optional[torch.Tensor], want_codes: bool = False):
    """(dequantized [groups, size], codes [groups, size] as float32 or None): the formulas, op by
    op in float32, in place on one temporary."""
    bottom, top = _levels(bits, symmetric)
    s = scale.unsqueeze(1)
    lo = offset.unsqueeze(1)
    t = xg / s if symmetric else torch.sub(xg, lo).div_(s)
    if noise is not None:
        t.add_(noise.view_as(t)).floor_()
    else:
        t.round_()
    t.clamp_(bottom, top)
    zero = scale == 0  # constant groups: unchanged (codes 0)
    any_zero = bool(zero.any())
    codes = None
    if want_codes:
        codes = t.clone()
        if any_zero:
            codes[zero] = 0
    out = t.mul_(s)
    if not symmetric:
        out.add_(lo)
    if any_zero:
        out[zero] = xg[zero]
    return out, codes


def _native_call(native, flat, out, noise, codes, scale, offset, groups, bits, symmetric, compute_scales,
                 num_threads) -> None:
    if flat.device.type != "cpu":
        raise ValueError(f"the native quantizer op runs CPU tensors; x is on {flat.device}")
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    native.quantize(flat.data_ptr(), ptr(out), ptr(noise), ptr(codes), scale.data_ptr(), offset.data_ptr(),
                    flat.numel(), groups, bits, bool(symmetric), bool(compute_scales), thread_count(num_threads))


def _qdq(x, bits, groups, symmetric, stochastic, generator, native, num_threads=None) -> torch.Tensor:
    _check_x(x)
    bits = _check_bits(bits, symmetric)
    groups = _check_groups(x, groups)
    n = x.numel()
    if n == 0:
        return x.detach().clone()
    flat = _flat32(x)
    noise = _noise(n, generator, x.device) if stochastic else None
    if native is not None:
        out = torch.empty_like(flat)
        scale = torch.empty(groups, dtype=torch.float32)
        offset = torch.empty(groups, dtype=torch.float32)
        _native_call(native, flat, out, noise, None, scale, offset, groups, bits, symmetric, True, num_threads)
    else:
        with torch.no_grad():
            xg = flat.view(groups, -1)
            scale, offset = _torch_scales(xg, bits, symmetric)
            out, _ = _torch_apply(xg, scale, offset, bits, symmetric, noise)
    return out.view(x.shape).to(x.dtype)


def _pick(x: torch.Tensor):
    return _native_or_none() if x.device.type == "cpu" else None


def _torch_quantize_dequantize(x, bits, groups=1, symmetric=True, stochastic=False, generator=None):
    """quantize_dequantize through the pure-torch fallback (any device)."""
    return _qdq(x, bits, groups, symmetric, stochastic, generator, None)


def _native_quantize_dequantize(x, bits, groups=1, symmetric=True, stochastic=False, generator=None, *,
                                num_threads=None):
    """quantize_dequantize through the native op; OpUnavailableError when it is not available."""
    return _qdq(x, bits, groups, symmetric, stochastic, generator, _require_native(), num_threads)


# --------------------------------------------------------------------------- public API
def quantize_dequantize(x: torch.Tensor, bits: int, groups: int = 1, symmetric: bool = True,
                        stochastic: bool = False, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Fake-quantize ``x`` per group (see the module docstring for the formulas)."""
    _check_x(x)
    return _qdq(x, bits, groups, symmetric, stochastic, generator, _pick(x))


def _range_params(bits: int, lo, hi, symmetric: bool, device) -> Tuple[torch.Tensor, torch.Tensor]:
    def as32(name, v):
        t = v.detach() if isinstance(v, torch.Tensor) else v
        if isinstance(t, torch.Tensor) and t.numel() != 1:
            raise ValueError(f"{name} must be a python float or a 0-dim tensor, got shape {tuple(t.shape)}")
        return torch.as_tensor(t, dtype=torch.float32, device=device).reshape(1)

    lo_t, hi_t = as32("lo", lo), as32("hi", hi)
    if float(lo_t) > float(hi_t):
        raise ValueError(f"lo={float(lo_t)} must be <= hi={float(hi_t)}")
    _, top = _levels(bits, symmetric)
    if symmetric:
        scale = torch.maximum(lo_t.abs(), hi_t.abs()) / top
        return scale, torch.zeros_like(scale)
    return (hi_t - lo_t) / top, lo_t


def _qdq_range(x, bits, lo, hi, symmetric, native, num_threads=None) -> torch.Tensor:
    _check_x(x)
    bits = _check_bits(bits, symmetric)
    n = x.numel()
    flat = _flat32(x)
    scale, offset = _range_params(bits, lo, hi, symmetric, flat.device)
    if n == 0:
        return x.detach().clone()
    if native is not None:
        out = torch.empty_like(flat)
        scale, offset = scale.cpu().contiguous(), offset.cpu().contiguous()
        _native_call(native, flat, out, None, None, scale, offset, 1, bits, symmetric, False, num_threads)
    else:
        with torch.no_grad():
            out, _ = _torch_apply(flat.view(1, -1), scale, offset, bits, symmetric, None)
    return out.view(x.shape).to(x.dtype)


def quantize_dequantize_range(x: torch.Tensor, bits: int, lo, hi, symmetric: bool = True) -> torch.Tensor:
    """Fake-quantize ``x`` with the static range [lo, hi] (see the module docstring)."""
    _check_x(x)
    return _qdq_range(x, bits, lo, hi, symmetric, _pick(x))


def _rows(x: torch.Tensor) -> int:
    if x.dim() == 0:
        return 1
    return x.numel() // x.shape[-1] if x.shape[-1] else 1


def quantize_dequantize_rows(x: torch.Tensor, bits: int, symmetric: bool = True) -> torch.Tensor:
    """Per-row (per-token) dynamic fake quantization of ``x`` viewed as (-1, x.shape[-1])."""
    _check_x(x)
    return quantize_dequantize(x, bits, groups=_rows(x), symmetric=symmetric)


# --------------------------------------------------------------------------- straight-through estimator
class _StraightThrough(torch.autograd.Function):
    """forward: fn(x, **kwargs); backward: the incoming gradient, unchanged, for x."""

    @staticmethod
    def forward(ctx, x, fn, kwargs):
        return fn(x, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize(x: torch.Tensor, bits: int, groups: int = 1, symmetric: bool = True, stochastic: bool = False,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """quantize_dequantize with a straight-through gradient."""
    return _StraightThrough.apply(x, quantize_dequantize, dict(bits=bits, groups=groups, symmetric=symmetric,
                                                               stochastic=stochastic, generator=generator))


def fake_quantize_range(x: torch.Tensor, bits: int, lo, hi, symmetric: bool = True) -> torch.Tensor:
    """quantize_dequantize_range with a straight-through gradient (none flows to lo / hi)."""
    return _StraightThrough.apply(x, quantize_dequantize_range, dict(bits=bits, lo=lo, hi=hi, symmetric=symmetric))


def fake_quantize_rows(x: torch.Tensor, bits: int, symmetric: bool = True) -> torch.Tensor:
    """quantize_dequantize_rows with a straight-through gradient."""
    return _StraightThrough.apply(x, quantize_dequantize_rows, dict(bits=bits, symmetric=symmetric))


# --------------------------------------------------------------------------- integer storage
@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """Integer codes + per-group float32 scale / offset of a tensor (see quantize_to_int)."""

    q: torch.Tensor  # int8 (symmetric) / uint8 (asymmetric), the original shape
    scale: torch.Tensor  # float32 [groups]
    offset: torch.Tensor  # float32 [groups]; zeros for symmetric
    shape: Tuple[int, ...]
    dtype: torch.dtype
    bits: int
    symmetric: bool

    @property
    def groups(self) -> int:
        return self.scale.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of storage: the codes plus the scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def state_dict(self) -> dict:
        """Plain tensors, ints, strings and bools (``torch.load(weights_only=True)`` reads it)."""
        return {"format": STATE_FORMAT, "q": self.q, "scale": self.scale, "offset": self.offset,
                "shape": [int(s) for s in self.shape], "dtype": _DTYPE_NAMES[self.dtype], "bits": int(self.bits),
                "symmetric": bool(self.symmetric)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "QuantizedTensor":
        missing = sorted({"q", "scale", "offset", "shape", "dtype", "bits", "symmetric"} - set(state))
        if missing:
            raise ValueError(f"not a QuantizedTensor state dict: missing {', '.join(missing)}")
        fmt = state.get("format", STATE_FORMAT)
        if fmt != STATE_FORMAT:
            raise ValueError(f"unknown QuantizedTensor format {fmt!r} (this version reads {STATE_FORMAT!r})")
        dtypes = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
        if state["dtype"] not in dtypes:
            raise ValueError(f"dtype {state['dtype']!r} is not one of {', '.join(dtypes)}")
        symmetric = bool(state["symmetric"])
        q, scale, offset = state["q"], state["scale"], state["offset"]
        want = torch.int8 if symmetric else torch.uint8
        if q.dtype != want:
            raise ValueError(f"q has dtype {q.dtype}; {'symmetric' if symmetric else 'asymmetric'} codes are {want}")
        shape = tuple(int(s) for s in state["shape"])
        if q.numel() != math.prod(shape) or scale.numel() != offset.numel() or (
                scale.numel() and q.numel() % scale.numel()):
            raise ValueError(f"inconsistent QuantizedTensor: q {tuple(q.shape)}, shape {shape}, "
                             f"{scale.numel()} scales, {offset.numel()} offsets")
        return cls(q=q.reshape(shape), scale=scale.to(torch.float32), offset=offset.to(torch.float32), shape=shape,
                   dtype=dtypes[state["dtype"]], bits=_check_bits(int(state["bits"]), symmetric, 8),
                   symmetric=symmetric)

    def __repr__(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return (f"QuantizedTensor(shape={self.shape}, dtype={self.dtype}, bits={self.bits}, {kind}, "
                f"groups={self.groups}, nbytes={self.nbytes})")


def _to_int(x, bits, groups, symmetric, native, num_threads=None) -> QuantizedTensor:
    _check_x(x)
    bits = _check_bits(bits, symmetric, max_bits=8)
    groups = _check_groups(x, groups)
    flat = _flat32(x)
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        raise ValueError("quantize_to_int: x holds NaN or infinite values, which integer codes cannot represent")
    code_dtype = torch.int8 if symmetric else torch.uint8
    if flat.numel() == 0:
        scale = torch.zeros(groups, dtype=torch.float32, device=x.device)
        q = torch.empty(0, dtype=code_dtype, device=x.device)
        offset = torch.zeros_like(scale)
    elif native is not None:
        q = torch.empty(flat.numel(), dtype=code_dtype)
        scale = torch.empty(groups, dtype=torch.float32)
        offset = torch.empty(groups, dtype=torch.float32)
        _native_call(native, flat, None, None, q, scale, offset, groups, bits, symmetric, True, num_threads)
    else:
        with torch.no_grad():
            xg = flat.view(groups, -1)
            scale, offset = _torch_scales(xg, bits, symmetric)
            _, codes = _torch_apply(xg, scale, offset, bits, symmetric, None, want_codes=True)
            q = codes.reshape(-1).to(code_dtype)
    return QuantizedTensor(q=q.view(x.shape), scale=scale, offset=offset, shape=tuple(x.shape), dtype=x.dtype,
                           bits=bits, symmetric=bool(symmetric))


def quantize_to_int(x: torch.Tensor, bits: int, groups: int = 1, symmetric: bool = True) -> QuantizedTensor:
    """Integer codes of ``x`` (bits <= 8, one byte per value); ``dequantize`` of the result equals
    ``quantize_dequantize(x, bits, groups, symmetric)``."""
    _check_x(x)
    return _to_int(x, bits, groups, symmetric, _pick(x))


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """The float tensor the codes stand for, in the original dtype and shape."""
    groups = qt.scale.numel()
    if qt.q.numel() == 0:
        return torch.empty(qt.shape, dtype=qt.dtype, device=qt.q.device)
    with torch.no_grad():
        t = qt.q.reshape(groups, -1).to(torch.float32)
        out = t * qt.scale.unsqueeze(1)
        if not qt.symmetric:
            out = out + qt.offset.unsqueeze(1)
    return out.view(qt.shape).to(qt.dtype)
