"""Block-sparse attention numerics: for every sparsity mode, sparse attention (native op and torch
fallback) equals dense attention computed in float64 with the layout expanded to an explicit
token mask (outputs and gradients of q, k, v, and of a relative position embedding); the native
building blocks (SDDMM, softmax, SpMM and their backward forms) equal the fallback's; results do
not depend on the thread count; long sequences run on CPU."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from dsplug.op_builder import LazyNativeOp, NativeOpsFallbackWarning, SparseAttnBuilder, native_disabled
from dsplug.op_builder import builder as builder_mod
from dsplug.plugins.sparse_attention import kernels as K
from dsplug.plugins.sparse_attention.layout import BlockLayout
from dsplug.plugins.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
)
from tests.conftest import scaled

NEG = float("-inf")


@pytest.fixture(scope="module")
def native():
    """The native op (built once into the default cache or $DSPLUG_OPS_CACHE), else skip."""
    why = "DSPLUG_DISABLE_NATIVE_OPS is set" if native_disabled() else SparseAttnBuilder().incompatibility()
    if why:
        pytest.skip(f"native op sparse_attn cannot be built here: {why}")
    return SparseAttnBuilder().load(fallback=False).native


BACKENDS = [pytest.param("native", id="native"), pytest.param("torch", id="torch")]


def _backend(name, request):
    if name == "native":
        request.getfixturevalue("native")
    return name


# --------------------------------------------------------------------------- the reference
def token_mask(layout: torch.Tensor, block: int) -> torch.Tensor:
    """[H, nb, nb] block layout -> [H, S, S] bool token mask (written independently of BlockLayout)."""
    H, nb, _ = layout.shape
    out = torch.zeros(H, nb * block, nb * block, dtype=torch.bool)
    for h, r, c in (layout != 0).nonzero().tolist():
        out[h, r * block:(r + 1) * block, c * block:(c + 1) * block] = True
    return out


def dense_attention(q, k, v, mask, *, scale, rpe=None, kp_add=None, am_add=None, causal=False):
    """Plain float64 attention with an explicit [H, S, S] mask."""
    s = (q @ k.transpose(-1, -2)) * scale
    if rpe is not None:
        s = s + rpe
    if kp_add is not None:
        s = s + kp_add[:, None, None, :]
    if am_add is not None:
        s = s + am_add
    s = s.masked_fill(~mask, NEG)
    if causal:
        S = q.shape[-2]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), NEG)
    return torch.softmax(s, dim=-1) @ v


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


MODES = {
    "dense": DenseSparsityConfig(2, block=16),
    "fixed": FixedSparsityConfig(2, block=16, num_local_blocks=2, horizontal_global_attention=True),
    "fixed-uni": FixedSparsityConfig(2, 16, True, num_local_blocks=4, num_global_blocks=2, attention="unidirectional",
                                     num_different_global_patterns=2),
    "variable": VariableSparsityConfig(2, 16, True, num_random_blocks=1, local_window_blocks=[1, 2],
                                       global_block_indices=[0, 5], global_block_end_indices=[1, 7],
                                       horizontal_global_attention=True, seed=0),
    "variable-uni": VariableSparsityConfig(2, 16, False, num_random_blocks=2, attention="unidirectional", seed=1),
    "bigbird": BigBirdSparsityConfig(2, 16, True, num_random_blocks=2, seed=3),
    "bigbird-uni": BigBirdSparsityConfig(2, 16, True, num_random_blocks=2, attention="unidirectional", seed=4),
    "bslongformer": BSLongformerSparsityConfig(2, 16, num_sliding_window_blocks=3, global_block_indices=[0, 6]),
    "bslongformer-uni": BSLongformerSparsityConfig(2, 16, True, global_block_indices=[2], global_block_end_indices=[4],
                                                   attention="unidirectional"),
    "sliding-window": LocalSlidingWindowSparsityConfig(2, 16, num_sliding_window_blocks=3),
}


# --------------------------------------------------------------------------- sparse == dense
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_equals_dense_attention_with_the_layout_as_mask(mode, backend, request):
    backend = _backend(backend, request)
    cfg = MODES[mode]
    B, H, S, D = 2, 2, 128, 32
    layout = cfg.make_layout(S)
    causal = cfg.attention_type == "unidirectional"
    q, k, v = (rand(B, H, S, D, seed=i, dtype=torch.float64).requires_grad_() for i in range(3))
    kp = torch.zeros(B, S, dtype=torch.float64)
    kp[0, -3:] = -10000.0  # key padding of the first sample's last three tokens ("add" mode)
    scale = D ** -0.5
    want = dense_attention(q, k, v, token_mask(layout, 16), scale=scale, kp_add=kp, causal=causal)
    grad_out = rand(B, H, S, D, seed=9, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    got = K.block_sparse_attention(q32, k32, v32, layout, 16, key_padding_mask=kp.float(), causal=causal,
                                   backend=backend)
    got_grads = torch.autograd.grad(got, (q32, k32, v32), grad_out.float())
    assert got.dtype == torch.float32 and got.shape == (B, H, S, D)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, atol=5e-5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_rpe_and_rpe_gradient_equal_the_dense_reference(backend, request):
    backend = _backend(backend, request)
    cfg = FixedSparsityConfig(2, 16, True, num_local_blocks=2, num_different_global_patterns=2)
    B, H, S, D = 2, 2, 96, 16
    layout = cfg.make_layout(S)
    q, k, v = (rand(B, H, S, D, seed=10 + i, dtype=torch.float64).requires_grad_() for i in range(3))
    rpe = (rand(1, H, S, S, seed=20, dtype=torch.float64) * 0.5).requires_grad_()  # broadcast over the batch
    kp_bool = torch.ones(B, 1, 1, S, dtype=torch.bool)
    kp_bool[1, ..., 40:50] = False  # a bool mask: True = attend
    attn01 = (rand(S, S, seed=21) > -1.0).to(torch.float64)  # "mul" mode: 0 masks
    attn01.fill_diagonal_(1.0)
    kp_add = torch.where(kp_bool.reshape(B, S), 0.0, NEG).double()
    am_add = torch.where(attn01 == 0, NEG, 0.0).double()
    want = dense_attention(q, k, v, token_mask(layout, 16), scale=0.3, rpe=rpe, kp_add=kp_add, am_add=am_add)
    grad_out = rand(B, H, S, D, seed=22, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (q, k, v, rpe), grad_out)

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    rpe32 = rpe.detach().float().requires_grad_()
    got = K.block_sparse_attention(q32, k32, v32, layout, 16, scale=0.3, rpe=rpe32, key_padding_mask=kp_bool,
                                   attn_mask=attn01.float(), attn_mask_mode="mul", backend=backend)
    got_grads = torch.autograd.grad(got, (q32, k32, v32, rpe32), grad_out.float())
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    for name, g, w in zip(["q", "k", "v", "rpe"], got_grads, want_grads):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, atol=5e-5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mul_and_add_key_padding_modes_agree(backend, request):
    backend = _backend(backend, request)
    layout = FixedSparsityConfig(1, 16).make_layout(64)
    q, k, v = (rand(2, 1, 64, 8, seed=30 + i) for i in range(3))
    keep = torch.ones(2, 64)
    keep[0, 10:20] = 0
    by_mul = K.block_sparse_attention(q, k, v, layout, 16, key_padding_mask=keep, key_padding_mask_mode="mul",
                                      backend=backend)
    by_add = K.block_sparse_attention(q, k, v, layout, 16, key_padding_mask=torch.where(keep == 0, NEG, 0.0),
                                      backend=backend)
    assert torch.equal(by_mul, by_add)


# --------------------------------------------------------------------------- native == fallback
BLOCK_CASES = [(16, 64), (32, 64), (64, 48), (128, 32), (8, 24), (24, 40)]  # (block, head_dim): fast and generic paths


def _random_layout(H, nb, seed, density=0.35):
    g = torch.Generator().manual_seed(seed)
    layout = (torch.rand(H, nb, nb, generator=g) < density).long()
    layout[:, torch.arange(nb), torch.arange(nb)] = 1
    return layout


@pytest.mark.parametrize("block,D", BLOCK_CASES)
def test_native_building_blocks_equal_the_fallback(native, block, D):
    B, H, nb = 2, 2, 5
    S = nb * block
    layout = _random_layout(H, nb, seed=block)
    layout[1, 3, :] = 0  # an empty block-row and block-column exercise the zero-output paths
    layout[1, :, 2] = 0
    L = BlockLayout(layout, block)
    a, b = rand(B, H, S, D, seed=1), rand(B, H, S, D, seed=2)
    sdd = {be: K.sdd_matmul(a, b, L, backend=be) for be in ("native", "torch")}
    # sums of up to block * nb products of N(0, 1) values: float32 rounding of different orders
    torch.testing.assert_close(sdd["native"], sdd["torch"], atol=1e-4, rtol=1e-5)
    vals = rand(B, L.nnz, block, block, seed=3)
    for transpose in (False, True):
        out = {be: K.dsd_matmul(vals, b, L, alpha=0.7, transpose=transpose, backend=be) for be in ("native", "torch")}
        torch.testing.assert_close(out["native"], out["torch"], atol=1e-4, rtol=1e-5)
    kp = torch.zeros(B, S)
    kp[1, :block] = NEG
    rpe = rand(B, 1, S, S, seed=4)
    soft = {be: K.sparse_softmax(vals, L, scale=0.5, rpe=rpe, key_padding_mask=kp, causal=True, backend=be)
            for be in ("native", "torch")}
    torch.testing.assert_close(soft["native"], soft["torch"], atol=1e-6, rtol=1e-5)
    grad = rand(B, L.nnz, block, block, seed=5)
    back = {be: K.sparse_softmax_backward(soft["torch"], grad, L, backend=be) for be in ("native", "torch")}
    torch.testing.assert_close(back["native"], back["torch"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block,D", BLOCK_CASES)
def test_native_attention_equals_the_fallback_forward_and_backward(native, block, D):
    B, H, nb = 2, 2, 6
    S = nb * block
    layout = _random_layout(H, nb, seed=100 + block)
    q, k, v = (rand(B, H, S, D, seed=40 + i) for i in range(3))
    rpe = rand(B, H, S, S, seed=45) * 0.1
    kp = torch.zeros(B, S)
    kp[0, -block // 2:] = -1e4
    grad_out = rand(B, H, S, D, seed=46)
    results = {}
    for be in ("native", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, rpe)]
        out = K.block_sparse_attention(*leaves[:3], layout, block, rpe=leaves[3], key_padding_mask=kp, causal=True,
                                       backend=be)
        results[be] = [out] + list(torch.autograd.grad(out, leaves, grad_out))
    for name, n, t in zip(["out", "dq", "dk", "dv", "drpe"], results["native"], results["torch"]):
        torch.testing.assert_close(n, t, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_results_do_not_depend_on_the_thread_count(native):
    layout = FixedSparsityConfig(4, 16, num_local_blocks=2).make_layout(256)
    q, k, v = (rand(2, 4, 256, 32, seed=50 + i).requires_grad_() for i in range(3))
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = K.block_sparse_attention(q, k, v, layout, 16, backend="native")
            runs.append([out] + list(torch.autograd.grad(out.square().sum(), (q, k, v))))
    finally:
        torch.set_num_threads(before)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_nothing_to_attend_to_are_zero_without_nan(backend, request):
    backend = _backend(backend, request)
    layout = torch.ones(1, 4, 4, dtype=torch.long)
    layout[0, 2, :] = 0  # block-row 2 attends to nothing
    q, k, v = (rand(2, 1, 64, 8, seed=60 + i).requires_grad_() for i in range(3))
    kp = torch.zeros(2, 64)
    kp[1, :] = NEG  # every key of sample 1 is padding
    out = K.block_sparse_attention(q, k, v, layout, 16, key_padding_mask=kp, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.all(out[0, 0, 32:48] == 0) and torch.all(out[1] == 0)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][1] == 0) and torch.all(grads[2][1] == 0)
    # the other rows are ordinary attention over their blocks
    mask = token_mask(layout, 16)
    want = dense_attention(q[:1].double(), k[:1].double(), v[:1].double(), mask, scale=8 ** -0.5)
    keep = torch.ones(64, dtype=torch.bool)
    keep[32:48] = False
    torch.testing.assert_close(out[0, 0, keep].double(), want[0, 0, keep], atol=2e-5, rtol=1e-4)


def test_half_precision_inputs_compute_in_float32():
    layout = BigBirdSparsityConfig(2, 16, num_random_blocks=1, seed=0).make_layout(64)
    q, k, v = (rand(1, 2, 64, 16, seed=70 + i) for i in range(3))
    want = K.block_sparse_attention(q, k, v, layout, 16)
    for dtype in (torch.bfloat16, torch.float16):
        args = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        got = K.block_sparse_attention(*args, layout, 16)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
        grads = torch.autograd.grad(got.float().sum(), args)
        assert all(g.dtype == dtype and torch.isfinite(g.float()).all() for g in grads)


def test_long_sequence_runs_on_cpu_and_matches_dense_rows(native):
    """8192 tokens, fixed layout: forward and backward run (memory O(S * D) plus per-thread tiles);
    a few query blocks are checked against dense attention computed for those rows only."""
    cfg = FixedSparsityConfig(1, 32, num_local_blocks=4)
    S, D = 8192, 16
    layout = cfg.make_layout(S)
    q, k, v = (rand(1, 1, S, D, seed=80 + i).requires_grad_() for i in range(3))
    out = K.block_sparse_attention(q, k, v, layout, 32)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    mask = layout[0].bool().repeat_interleave(32, 0).repeat_interleave(32, 1)
    for r in (0, 100, 255):
        rows = slice(r * 32, (r + 1) * 32)
        s = (q[0, 0, rows].double() @ k[0, 0].double().T) * D ** -0.5
        want = torch.softmax(s.masked_fill(~mask[rows], NEG), -1) @ v[0, 0].double()
        torch.testing.assert_close(out[0, 0, rows].detach().double(), want, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- errors and backends
def test_bad_arguments_name_what_is_wrong():
    layout = DenseSparsityConfig(2, 16).make_layout(64)
    q = torch.zeros(1, 2, 64, 8)
    with pytest.raises(ValueError, match="seq_len=60, which is not a multiple of block=16"):
        K.block_sparse_attention(torch.zeros(1, 2, 60, 8), torch.zeros(1, 2, 60, 8), torch.zeros(1, 2, 60, 8),
                                 layout, 16)
    with pytest.raises(ValueError, match="3 heads .* layout is for 2 heads"):
        K.block_sparse_attention(torch.zeros(1, 3, 64, 8), torch.zeros(1, 3, 64, 8), torch.zeros(1, 3, 64, 8),
                                 layout, 16)
    with pytest.raises(ValueError, match=r"key has shape \(1, 2, 64, 4\); expected query's shape"):
        K.block_sparse_attention(q, torch.zeros(1, 2, 64, 4), q, layout, 16)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 64\); expected \[batch=1"):
        K.block_sparse_attention(q, q, q, layout, 16, key_padding_mask=torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(64, 32\); expected \[seq_len, seq_len\]"):
        K.block_sparse_attention(q, q, q, layout, 16, attn_mask=torch.zeros(64, 32))
    with pytest.raises(ValueError, match="key_padding_mask_mode='sub' is not valid"):
        K.block_sparse_attention(q, q, q, layout, 16, key_padding_mask_mode="sub")
    with pytest.raises(ValueError, match=r"rpe has shape \(3, 64, 64\)"):
        K.block_sparse_attention(q, q, q, layout, 16, rpe=torch.zeros(3, 64, 64))
    with pytest.raises(ValueError, match="backend='cuda' is not valid"):
        K.block_sparse_attention(q, q, q, layout, 16, backend="cuda")
    with pytest.raises(ValueError, match="backend='native' needs CPU tensors of dtype float32"):
        K.block_sparse_attention(q.double(), q.double(), q.double(), layout, 16, backend="native")
    with pytest.raises(ValueError, match=r"vals must have shape \[batch, nnz=32, block=16, block=16\]"):
        K.dsd_matmul(torch.zeros(1, 3, 16, 16), q, layout, 16)
    with pytest.raises(TypeError, match="layout must be an integer or bool tensor"):
        BlockLayout(torch.ones(2, 4, 4), 16)


def test_float64_runs_the_fallback_in_float64():
    layout = FixedSparsityConfig(1, 8, num_local_blocks=2).make_layout(32)
    q, k, v = (rand(1, 1, 32, 4, seed=90 + i, dtype=torch.float64) for i in range(3))
    out = K.block_sparse_attention(q, k, v, layout, 8)
    want = dense_attention(q, k, v, token_mask(layout, 8), scale=0.5)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_disabled_native_ops_fall_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("DSPLUG_DISABLE_NATIVE_OPS", "1")
    monkeypatch.setattr(builder_mod, "_WARNED", set())
    monkeypatch.setattr(K, "_NATIVE", LazyNativeOp(SparseAttnBuilder))
    layout = DenseSparsityConfig(1, 16).make_layout(32)
    q = rand(1, 1, 32, 8, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = K.block_sparse_attention(q, q, q, layout, 16)
        K.block_sparse_attention(q, q, q, layout, 16)
    fallback = [w for w in caught if issubclass(w.category, NativeOpsFallbackWarning)]
    assert len(fallback) == 1 and "sparse_attn" in str(fallback[0].message)
    assert K.backend() == "torch fallback" and not K.native_available()
    want = torch.softmax((q @ q.transpose(-1, -2)) / math.sqrt(8), -1) @ q
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_portable_build_equals_the_fallback(monkeypatch):
    """The op compiled without the machine's vector extensions (DSPLUG_OPS_ISA=scalar: 4-float
    generic vectors, other register tiles) computes the same as the fallback."""
    builder = SparseAttnBuilder(isa="scalar")
    why = "DSPLUG_DISABLE_NATIVE_OPS is set" if native_disabled() else builder.incompatibility()
    if why:
        pytest.skip(f"native op sparse_attn (scalar) cannot be built here: {why}")
    op = builder.load(fallback=False)
    assert op.native.simd_isa() == "scalar"
    scalar = LazyNativeOp(SparseAttnBuilder)
    scalar.op = op  # resolved to the scalar build
    monkeypatch.setattr(K, "_NATIVE", scalar)
    for block, D in ((16, 64), (32, 20), (8, 8)):
        layout = _random_layout(2, 4, seed=block)
        q, k, v = (rand(2, 2, 4 * block, D, seed=block + i) for i in range(3))
        results = {}
        for be in ("native", "torch"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = K.block_sparse_attention(*leaves, layout, block, causal=True, backend=be)
            results[be] = [out] + list(torch.autograd.grad(out.sum(), leaves))
        for n, t in zip(results["native"], results["torch"]):
            torch.testing.assert_close(n, t, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- review fixes
def test_all_zero_layout_native_equals_fallback(native):
    """A layout without a nonzero block: every row attends to nothing, so the output and the
    gradients of q, k, v and rpe are zeros on both backends (the native op used to reject the
    empty index arrays), and the building blocks agree on the empty problem."""
    layout = torch.zeros(2, 3, 3, dtype=torch.long)
    L = BlockLayout(layout, 16)
    assert L.nnz == 0
    q, k, v = (rand(2, 2, 48, 8, seed=70 + i) for i in range(3))
    rpe = rand(1, 2, 48, 48, seed=75)
    grad_out = rand(2, 2, 48, 8, seed=76)
    results = {}
    for be in ("native", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, rpe)]
        out = K.block_sparse_attention(*leaves[:3], layout, 16, rpe=leaves[3], causal=True, backend=be)
        results[be] = [out] + list(torch.autograd.grad(out, leaves, grad_out))
    for name, n, t, ref in zip(["out", "dq", "dk", "dv", "drpe"], results["native"], results["torch"],
                               (q, q, k, v, rpe)):
        assert n.shape == t.shape == ref.shape, name
        assert torch.equal(n, torch.zeros_like(ref)) and torch.equal(t, torch.zeros_like(ref)), name
    x = {be: K.sdd_matmul(q, k, L, backend=be) for be in ("native", "torch")}
    assert x["native"].shape == x["torch"].shape == (2, 0, 16, 16)
    soft = {be: K.sparse_softmax(x[be], L, backend=be) for be in ("native", "torch")}
    assert soft["native"].shape == (2, 0, 16, 16)
    back = {be: K.sparse_softmax_backward(soft[be], x[be], L, backend=be) for be in ("native", "torch")}
    assert back["native"].shape == (2, 0, 16, 16)
    for transpose in (False, True):
        o = {be: K.dsd_matmul(x[be], v, L, transpose=transpose, backend=be) for be in ("native", "torch")}
        assert torch.equal(o["native"], torch.zeros_like(v)) and torch.equal(o["torch"], torch.zeros_like(v))


_PARALLEL_FAILURE_SCRIPT = """
import sys
from dsplug.op_builder import SparseAttnBuilder
native = SparseAttnBuilder().load(fallback=False).native
for fail in range(50, 1000, 100):  # failing units land on the calling thread and on workers
    try:
        native._parallel_units_check(1000, 4, fail)
    except RuntimeError as e:
        assert str(e) == f"unit {fail} failed", str(e)
        print("raised:", e)
    else:
        print("no exception")
        sys.exit(3)
assert native._parallel_units_check(1000, 4, -1) == 1000  # the pool still works
"""


def test_an_exception_in_a_worker_thread_reaches_python(native):
    """A unit that throws inside a worker thread must surface as a Python exception after every
    claimed unit finished (no std::terminate of the process). Runs in a subprocess so a
    regression shows as a failed test rather than a killed test run."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PARALLEL_FAILURE_SCRIPT], capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.count("raised: unit") == 10, proc.stdout
    # with no failure every unit runs exactly once
    assert native._parallel_units_check(1000, 4, -1) == 1000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for an rpe on another device")
def test_rpe_on_another_device_than_cpu_inputs_is_moved(native):
    """CPU q/k/v with a CUDA rpe: the native path gets rpe on the inputs' device, and the rpe
    gradient comes back on rpe's device."""
    layout = torch.ones(1, 2, 2, dtype=torch.long)
    q, k, v = (rand(1, 1, 32, 8, seed=80 + i) for i in range(3))
    rpe = rand(1, 1, 32, 32, seed=85)
    outs = {}
    for name, r in (("cpu", rpe), ("cuda", rpe.cuda())):
        leaf = r.clone().requires_grad_()
        out = K.block_sparse_attention(q, k, v, layout, 16, rpe=leaf, backend="native")
        (g,) = torch.autograd.grad(out.sum(), leaf)
        assert g.device == r.device
        outs[name] = (out, g.cpu())
    torch.testing.assert_close(outs["cuda"][0], outs["cpu"][0])
    torch.testing.assert_close(outs["cuda"][1], outs["cpu"][1])
