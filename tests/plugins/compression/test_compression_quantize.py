"""dsplug.ops.quantize: the fake-quantization formulas against an independent
reference written here with python floats (each operation rounded to float32), the native
quantizer op against its pure-torch fallback (bitwise), stochastic rounding's statistics, the
straight-through gradient and the integer storage."""
from __future__ import annotations

import io
import math
import struct
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsplug.op_builder import (ALL_OPS, NativeOpsFallbackWarning, OpUnavailableError, QuantizerBuilder,
                               native_disabled, op_status)
from dsplug.op_builder import builder as builder_mod
from dsplug.ops import quantize as Q

HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --------------------------------------------------------------------------- the reference
def f32(v: float) -> float:
    """v rounded to float32 (to nearest even). An operation on float32 values done in python's
    double precision and rounded once is the correctly rounded float32 result (53 >= 2 * 24 + 2)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def reference(values, bits, groups=1, symmetric=True, noise=None):
    """The contract, element by element: python floats, round half to even, floor for stochastic."""
    n = len(values)
    size = n // groups
    out = []
    for g in range(groups):
        group = values[g * size:(g + 1) * size]
        if symmetric:
            top = 2 ** (bits - 1) - 1
            bottom, lo = -top, 0.0
            scale = f32(max(abs(v) for v in group) / top)
        else:
            top, bottom = 2 ** bits - 1, 0
            lo, hi = min(group), max(group)
            scale = f32(f32(hi - lo) / top)
        for k, v in enumerate(group):
            if scale == 0:
                out.append(v)
                continue
            t = f32(v / scale) if symmetric else f32(f32(v - lo) / scale)
            t = math.floor(f32(t + noise[g * size + k])) if noise is not None else round(t)  # round: half to even
            t = min(max(t, bottom), top)
            o = f32(t * scale)
            out.append(o if symmetric else f32(o + lo))
    return out


def reference_scales(values, bits, groups, symmetric):
    size = len(values) // groups
    scales = []
    for g in range(groups):
        group = values[g * size:(g + 1) * size]
        if symmetric:
            scales.append(f32(max(abs(v) for v in group) / (2 ** (bits - 1) - 1)))
        else:
            scales.append(f32(f32(max(group) - min(group)) / (2 ** bits - 1)))
    return scales


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, for bitwise comparison (-0.0 != 0.0, NaN payloads count)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    diff = (bits_of(a) != bits_of(b)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}: " \
                              f"{a.flatten()[diff[0]].item()} vs {b.flatten()[diff[0]].item()}"


def sample(n, seed=0, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(scope="module")
def native():
    """The native op (built once into the default cache or $DSPLUG_OPS_CACHE), else skip."""
    why = "DSPLUG_DISABLE_NATIVE_OPS is set" if native_disabled() else QuantizerBuilder().incompatibility()
    if why:
        pytest.skip(f"native op quantizer cannot be built here: {why}")
    return QuantizerBuilder().load(fallback=False).native


@pytest.fixture(scope="module")
def scalar_native():
    """The op compiled for the portable scalar path (DSPLUG_OPS_ISA=scalar)."""
    builder = QuantizerBuilder(isa="scalar")
    why = "DSPLUG_DISABLE_NATIVE_OPS is set" if native_disabled() else builder.incompatibility()
    if why:
        pytest.skip(f"native op quantizer (scalar) cannot be built here: {why}")
    return builder.load(fallback=False).native


CONFIGS = [(bits, groups, sym) for sym in (True, False) for bits in (2, 4, 8) for groups in (1, 4)]


# --------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("bits,groups,symmetric", CONFIGS)
def test_fallback_matches_reference_nearest(bits, groups, symmetric):
    x = sample(256, seed=bits * 10 + groups)
    expected = reference(x.tolist(), bits, groups, symmetric)
    got = Q._torch_quantize_dequantize(x, bits, groups, symmetric)
    assert got.tolist() == expected
    assert Q.quantize_dequantize(x, bits, groups, symmetric).tolist() == expected  # whichever backend


@pytest.mark.parametrize("bits,groups,symmetric", CONFIGS)
def test_native_matches_reference_and_fallback_bitwise(native, bits, groups, symmetric):
    x = sample(1000, seed=bits + groups) * 3 + 0.5  # 1000: SIMD body and a scalar tail
    x[7] = 0.0
    got = Q._native_quantize_dequantize(x, bits, groups, symmetric)
    assert got.tolist() == reference(x.tolist(), bits, groups, symmetric)
    assert_bitwise(got, Q._torch_quantize_dequantize(x, bits, groups, symmetric), f"bits={bits} groups={groups}")


def test_round_half_to_even():
    # symmetric 8-bit, absmax 127: scale = 1, so x / scale = x, ties included
    x = torch.tensor([127.0, 2.5, -1.5, 0.5, -0.5, 3.5, 1.4999999, -126.5])
    expected = [127.0, 2.0, -2.0, 0.0, -0.0, 4.0, 1.0, -126.0]
    assert Q._torch_quantize_dequantize(x, 8).tolist() == expected
    assert reference(x.tolist(), 8) == expected
    if Q.native_available():
        assert Q._native_quantize_dequantize(x, 8).tolist() == expected


def test_grid_and_range_properties():
    x = sample(512, seed=3) * 4
    for symmetric in (True, False):
        for bits in (2, 3, 5, 8, 12, 16):
            out = Q.quantize_dequantize(x, bits, symmetric=symmetric)
            if symmetric:
                scale = x.abs().max() / (2 ** (bits - 1) - 1)
                assert out.abs().max() <= x.abs().max() * (1 + 1e-6)
                q = out / scale
            else:
                scale = (x.max() - x.min()) / (2 ** bits - 1)
                q = (out - x.min()) / scale
                assert out.min() >= x.min() - 1e-6 and out.max() <= x.max() * (1 + 1e-6) + 1e-6
            assert torch.allclose(q, q.round(), atol=1e-3), (symmetric, bits)  # on the grid
            assert (out - x).abs().max() <= scale / 2 * (1 + 1e-4) + 1e-6  # nearest grid point
            assert len(set(out.tolist())) <= 2 ** bits


def test_one_bit_asymmetric_and_sixteen_bits():
    x = torch.tensor([0.0, 0.4, 0.6, 1.0])
    assert Q.quantize_dequantize(x, 1, symmetric=False).tolist() == [0.0, 0.0, 1.0, 1.0]
    y = sample(300, seed=9)
    for symmetric in (True, False):
        assert Q.quantize_dequantize(y, 16, symmetric=symmetric).tolist() == reference(y.tolist(), 16, 1, symmetric)


def test_constant_groups_are_unchanged():
    x = torch.cat([torch.full((8,), 1.7), torch.zeros(8), sample(8, seed=1), torch.full((8,), -3.25)])
    for fn in filter(None, (Q._torch_quantize_dequantize, Q.native_available() and Q._native_quantize_dequantize)):
        asym = fn(x, 4, 4, False)
        assert torch.equal(asym[:8], x[:8]) and torch.equal(asym[24:], x[24:])  # all equal: scale 0
        sym = fn(x, 4, 4, True)
        assert torch.equal(sym[8:16], x[8:16])  # symmetric scale 0: all zeros
        assert sym[:8].tolist() == reference(x[:8].tolist(), 4)  # nonzero constant: scale |c| / qmax
        assert not torch.equal(asym[16:24], x[16:24])


def test_non_finite_group_comes_out_nan(native):
    x = sample(64, seed=2)
    x[3], x[40] = float("nan"), float("inf")
    for symmetric in (True, False):
        for fn in (Q._torch_quantize_dequantize, Q._native_quantize_dequantize):
            out = fn(x, 8, 4, symmetric)
            assert torch.isnan(out[:16]).all() and torch.isnan(out[32:48]).all(), (fn, symmetric)
            assert torch.isfinite(out[16:32]).all() and torch.isfinite(out[48:]).all()


# --------------------------------------------------------------------------- native == fallback
@pytest.mark.parametrize("n,groups", [(1, 1), (15, 5), (17, 1), (4096, 1), (4096, 64), (3 * 2 ** 16 + 96, 1),
                                      (3 * 2 ** 16 + 96, 3), (3 * 2 ** 16, 3 * 2 ** 8), (2 ** 20, 2 ** 14)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_equals_fallback_bitwise_every_split(native, n, groups, threads):
    """Sizes above 2^15 elements per thread take the threaded paths (units of whole groups, or of
    2^16 elements with partial statistics, crossing group boundaries); the result must not depend
    on the split."""
    x = sample(n, seed=n + groups) * 2 - 0.25
    for symmetric in (True, False):
        for stochastic in (False, True):
            bits = 4 if stochastic else 8
            a = Q._native_quantize_dequantize(x, bits, groups, symmetric, stochastic,
                                              torch.Generator().manual_seed(5), num_threads=threads)
            b = Q._torch_quantize_dequantize(x, bits, groups, symmetric, stochastic, torch.Generator().manual_seed(5))
            assert_bitwise(a, b, f"n={n} groups={groups} symmetric={symmetric} stochastic={stochastic}")


@HYPOTHESIS
@given(group_size=st.integers(1, 40), groups=st.integers(1, 5), bits=st.integers(2, 16),
       symmetric=st.booleans(), stochastic=st.booleans(), seed=st.integers(0, 2 ** 16),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]))
def test_property_native_fallback_reference_agree(native, group_size, groups, bits, symmetric, stochastic, seed,
                                                  magnitude):
    x = sample(group_size * groups, seed=seed, scale=magnitude)
    noise = torch.rand(x.numel(), generator=torch.Generator().manual_seed(seed)).tolist() if stochastic else None
    expected = reference(x.tolist(), bits, groups, symmetric, noise)
    a = Q._native_quantize_dequantize(x, bits, groups, symmetric, stochastic, torch.Generator().manual_seed(seed))
    b = Q._torch_quantize_dequantize(x, bits, groups, symmetric, stochastic, torch.Generator().manual_seed(seed))
    assert a.tolist() == expected
    assert_bitwise(a, b)


def test_simd_path_equals_scalar_path(native, scalar_native):
    x = sample(5 * 19661, seed=11)  # 98305: threaded, groups not SIMD-aligned
    for symmetric in (True, False):
        for noise in (None, torch.rand(x.numel(), generator=torch.Generator().manual_seed(1))):
            outs = []
            for op in (native, scalar_native):
                out, scale, offset = torch.empty_like(x), torch.empty(5), torch.empty(5)
                op.quantize(x.data_ptr(), out.data_ptr(), 0 if noise is None else noise.data_ptr(), 0,
                            scale.data_ptr(), offset.data_ptr(), x.numel(), 5, 6, symmetric, True, 2)
                outs.append((out, scale, offset))
            for a, b in zip(*outs):
                assert_bitwise(a, b, f"symmetric={symmetric}")
            assert outs[0][1].tolist() == reference_scales(x.tolist(), 6, 5, symmetric)
    assert native.simd_isa() in ("avx512", "avx2", "scalar") and scalar_native.simd_isa() == "scalar"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    x = (sample(1024, seed=4) * 2).to(dtype).reshape(16, 64)
    expected = reference(x.float().flatten().tolist(), 8, 16, False)
    for fn in filter(None, (Q._torch_quantize_dequantize, Q.native_available() and Q._native_quantize_dequantize)):
        out = fn(x, 8, 16, False)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.equal(out, torch.tensor(expected).to(dtype).reshape(16, 64))
    if Q.native_available():
        for stochastic in (False, True):
            assert_bitwise(Q._native_quantize_dequantize(x, 4, 4, True, stochastic, torch.Generator().manual_seed(2)),
                           Q._torch_quantize_dequantize(x, 4, 4, True, stochastic, torch.Generator().manual_seed(2)))


def test_shapes_views_and_no_grad():
    x = sample(6 * 8, seed=5).reshape(6, 8).t()  # non-contiguous
    out = Q.quantize_dequantize(x, 4, groups=2)
    assert out.shape == (8, 6) and out.flatten().tolist() == reference(x.flatten().tolist(), 4, 2)
    p = torch.nn.Parameter(sample(16))
    assert not Q.quantize_dequantize(p, 8).requires_grad
    assert Q.quantize_dequantize(torch.empty(0, 3), 8).shape == (0, 3)
    assert Q.quantize_dequantize(torch.tensor(2.0), 8).item() == 2.0
    before = x.clone()
    Q.quantize_dequantize(x, 2, stochastic=True)
    assert torch.equal(x, before)  # the input is never modified


# --------------------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize("symmetric", [True, False])
def test_stochastic_exact_neighbours_and_seed(symmetric):
    x = sample(200, seed=6)
    noise = torch.rand(200, generator=torch.Generator().manual_seed(42)).tolist()
    got = Q.quantize_dequantize(x, 4, 2, symmetric, stochastic=True, generator=torch.Generator().manual_seed(42))
    assert got.tolist() == reference(x.tolist(), 4, 2, symmetric, noise)  # the same noise, the same formula
    again = Q.quantize_dequantize(x, 4, 2, symmetric, stochastic=True, generator=torch.Generator().manual_seed(42))
    assert_bitwise(got, again)
    other = Q.quantize_dequantize(x, 4, 2, symmetric, stochastic=True, generator=torch.Generator().manual_seed(43))
    assert not torch.equal(got, other)
    # every output is one of the two grid points around x
    size = 100
    for g, scale in enumerate(reference_scales(x.tolist(), 4, 2, symmetric)):
        lo = 0.0 if symmetric else min(x[g * size:(g + 1) * size].tolist())
        for v, o in zip(x[g * size:(g + 1) * size].tolist(), got[g * size:(g + 1) * size].tolist()):
            t = f32(v / scale) if symmetric else f32(f32(v - lo) / scale)
            neighbours = {f32(math.floor(t) * scale), f32(math.ceil(t) * scale)}
            if not symmetric:
                neighbours = {f32(k + lo) for k in neighbours}
            assert o in neighbours, (v, o, neighbours)


@pytest.mark.parametrize("symmetric", [True, False])
def test_stochastic_rounding_is_unbiased(symmetric):
    """K draws of the same 64 values (K identical groups share one scale): the mean converges to x
    within 5 standard deviations of the mean of a two-point distribution (<= scale / (2 sqrt K))."""
    k = 4000
    x = sample(64, seed=7)
    draws = Q.quantize_dequantize(x.repeat(k), 3, groups=k, symmetric=symmetric, stochastic=True,
                                  generator=torch.Generator().manual_seed(0)).view(k, 64)
    scale = reference_scales(x.tolist(), 3, 1, symmetric)[0]
    tolerance = 5 * scale / (2 * math.sqrt(k)) + 1e-6
    assert (draws.mean(0) - x).abs().max().item() <= tolerance
    nearest = Q.quantize_dequantize(x.repeat(k), 3, groups=k, symmetric=symmetric).view(k, 64)
    assert (nearest.mean(0) - x).abs().max().item() > tolerance  # nearest rounding is biased per value


# --------------------------------------------------------------------------- range and rows
@pytest.mark.parametrize("symmetric", [True, False])
def test_static_range(symmetric):
    x = sample(300, seed=8) * 3
    lo, hi = -1.0, 2.0
    out = Q.quantize_dequantize_range(x, 4, lo, hi, symmetric=symmetric)
    if symmetric:
        scale = f32(2.0 / 7)
        expected = [f32(min(max(round(f32(v / scale)), -7), 7) * scale) for v in x.tolist()]
        assert out.abs().max().item() <= 2.0 + 1e-6
    else:
        scale = f32(3.0 / 15)
        expected = [f32(f32(min(max(round(f32(f32(v + 1.0) / scale)), 0), 15) * scale) - 1.0) for v in x.tolist()]
        assert out.min().item() == -1.0 and abs(out.max().item() - 2.0) < 1e-6  # clamped to the range
    assert out.tolist() == expected
    tensors = Q.quantize_dequantize_range(x, 4, torch.tensor(lo), torch.tensor(hi, dtype=torch.float64), symmetric)
    assert torch.equal(tensors, out)
    assert torch.equal(Q.quantize_dequantize_range(x, 4, 0.0, 0.0, symmetric), x)  # degenerate range: unchanged
    if Q.native_available():
        with_native = Q._qdq_range(x.bfloat16(), 4, lo, hi, symmetric, Q._require_native(), num_threads=2)
        assert_bitwise(with_native, Q._qdq_range(x.bfloat16(), 4, lo, hi, symmetric, None))
    with pytest.raises(ValueError, match="lo=3.0 must be <= hi=1.0"):
        Q.quantize_dequantize_range(x, 4, 3.0, 1.0)


def test_rows_is_per_token():
    x = sample(5 * 3 * 16, seed=10).reshape(5, 3, 16)
    out = Q.quantize_dequantize_rows(x, 8, symmetric=False)
    assert torch.equal(out, Q.quantize_dequantize(x, 8, groups=15, symmetric=False))
    assert out.flatten().tolist() == reference(x.flatten().tolist(), 8, 15, False)
    assert torch.equal(Q.fake_quantize_rows(x, 8, False), out)


# --------------------------------------------------------------------------- validation
def test_bad_groups_and_bits_name_the_values():
    x = torch.zeros(10, 3)
    with pytest.raises(ValueError, match=r"numel=30 .*groups=4"):
        Q.quantize_dequantize(x, 8, groups=4)
    with pytest.raises(ValueError, match=r"groups=0"):
        Q.quantize_dequantize(x, 8, groups=0)
    with pytest.raises(ValueError, match=r"bits=17 .*2 <= bits <= 16"):
        Q.quantize_dequantize(x, 17)
    with pytest.raises(ValueError, match=r"bits=1 .*symmetric quantization needs 2 <= bits"):
        Q.quantize_dequantize(x, 1)
    with pytest.raises(ValueError, match=r"bits=0 .*asymmetric quantization needs 1 <= bits"):
        Q.quantize_dequantize(x, 0, symmetric=False)
    with pytest.raises(TypeError, match="bits must be an int"):
        Q.quantize_dequantize(x, 4.0)
    with pytest.raises(TypeError, match="float64"):
        Q.quantize_dequantize(x.double(), 8)
    with pytest.raises(ValueError, match=r"bits=9 .*<= 8"):
        Q.quantize_to_int(x, 9)
    with pytest.raises(ValueError, match="NaN or infinite"):
        Q.quantize_to_int(torch.tensor([1.0, float("inf")]), 8)


# --------------------------------------------------------------------------- straight-through estimator
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ste_gradient_is_the_upstream_gradient(dtype):
    x = sample(64, seed=12).to(dtype).reshape(8, 8).requires_grad_()
    upstream = sample(64, seed=13).to(dtype).reshape(8, 8)
    for fn, kwargs in ((Q.fake_quantize, dict(bits=4, groups=2, stochastic=True)),
                       (Q.fake_quantize, dict(bits=2, symmetric=False)),
                       (Q.fake_quantize_range, dict(bits=4, lo=-0.5, hi=0.5)),  # clamped values too
                       (Q.fake_quantize_rows, dict(bits=4))):
        x.grad = None
        y = fn(x, **kwargs)
        assert y.requires_grad and y.dtype == dtype
        y.backward(upstream)
        assert torch.equal(x.grad, upstream), fn.__name__
    y = Q.fake_quantize(x, 4, groups=2)
    assert torch.equal(y, Q.quantize_dequantize(x, 4, groups=2))


# --------------------------------------------------------------------------- integer storage
@pytest.mark.parametrize("bits,groups,symmetric", CONFIGS)
def test_int_round_trip_equals_quantize_dequantize(bits, groups, symmetric):
    x = (sample(512, seed=bits * groups) * 2 + 0.3).reshape(8, 64)
    x[0, :] = 0.75  # a constant group (asymmetric: scale 0)
    qt = Q.quantize_to_int(x, bits, groups, symmetric)
    assert qt.q.dtype == (torch.int8 if symmetric else torch.uint8) and qt.q.shape == x.shape
    assert qt.scale.dtype == qt.offset.dtype == torch.float32 and qt.scale.shape == (groups,)
    lo, hi = Q._levels(bits, symmetric)
    assert lo <= int(qt.q.min()) and int(qt.q.max()) <= hi
    if symmetric:
        assert not qt.offset.any()
    assert qt.scale.tolist() == reference_scales(x.flatten().tolist(), bits, groups, symmetric)
    assert torch.equal(Q.dequantize(qt), Q.quantize_dequantize(x, bits, groups, symmetric))
    if Q.native_available():
        for name, native in (("fallback", None), ("native", Q._require_native())):
            other = Q._to_int(x, bits, groups, symmetric, native, num_threads=2)
            assert torch.equal(other.q, qt.q) and torch.equal(other.scale, qt.scale), name
            assert torch.equal(other.offset, qt.offset), name


def test_int_storage_bytes_and_state_dict():
    w = sample(1000 * 1000, seed=14).reshape(1000, 1000).bfloat16()
    qt = Q.quantize_to_int(w, 8, groups=1000)
    assert qt.q.dtype == torch.int8 and qt.q.numel() * qt.q.element_size() == 1_000_000
    assert qt.nbytes == 1_000_000 + 2 * 4 * 1000  # codes + float32 scale and offset per group
    buf = io.BytesIO()
    torch.save(qt.state_dict(), buf)
    assert buf.tell() < 1_100_000  # about 1 MB on disk, half the bf16 weight
    buf.seek(0)
    back = Q.QuantizedTensor.from_state_dict(torch.load(buf, weights_only=True))
    assert back.shape == (1000, 1000) and back.dtype == torch.bfloat16 and back.bits == 8 and back.symmetric
    restored = back.dequantize()
    assert restored.dtype == torch.bfloat16 and torch.equal(restored, Q.quantize_dequantize(w, 8, groups=1000))
    with pytest.raises(ValueError, match="missing bits"):
        Q.QuantizedTensor.from_state_dict({k: v for k, v in qt.state_dict().items() if k != "bits"})
    asym = Q.quantize_to_int(w[:10], 4, symmetric=False)
    assert asym.q.dtype == torch.uint8 and "asymmetric" in repr(asym)
    assert torch.equal(Q.QuantizedTensor.from_state_dict(asym.state_dict()).dequantize(),
                       Q.quantize_dequantize(w[:10], 4, symmetric=False))


# --------------------------------------------------------------------------- op registration and fallback
def test_op_is_registered():
    assert ALL_OPS["quantizer"] is QuantizerBuilder
    status = op_status("quantizer")
    assert status.name == "quantizer" and isinstance(status.detail, str)
    assert QuantizerBuilder().absolute_name() == "dsplug.ops.quantizer_op"
    assert all(p.is_file() for p in QuantizerBuilder().source_paths())


def test_disable_env_forces_the_fallback_with_one_warning(monkeypatch):
    monkeypatch.setenv("DSPLUG_DISABLE_NATIVE_OPS", "1")
    monkeypatch.setattr(builder_mod, "_WARNED", set())
    x = sample(100, seed=15)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not Q.native_available() and Q.backend() == "torch fallback"
        out = Q.quantize_dequantize(x, 4)
        Q.quantize_dequantize(x, 4)
    ours = [w for w in caught if issubclass(w.category, NativeOpsFallbackWarning)]
    assert len(ours) == 1 and "quantizer" in str(ours[0].message)
    assert out.tolist() == reference(x.tolist(), 4)
    with pytest.raises(OpUnavailableError, match="disabled by DSPLUG_DISABLE_NATIVE_OPS"):
        Q._native_quantize_dequantize(x, 4)
