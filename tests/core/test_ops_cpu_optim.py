"""cpu_adam / cpu_adagrad / cpu_lion against torch.optim (and a closed-form Lion), the native
kernels against their pure-torch fallbacks, the SIMD path against the scalar one, the bf16
moment option, the half-precision output copy, and the DeepSpeed optimizer classes.

Tolerance "1e-6 relative": |actual - expected| <= 1e-6 * (|expected| + max|expected|), i.e.
elementwise relative error 1e-6 with an absolute floor of 1e-6 of the tensor's scale (values
that cancel to ~0, like a momentum, have no meaningful elementwise relative error).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsplug.op_builder import (CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder, NativeOpsFallbackWarning,
                               native_disabled)
from dsplug.ops.native.cpu_optim import AdagradKernel, AdamKernel, LionKernel

RTOL = 1e-6
HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def assert_rel(actual, expected, rtol=RTOL, what=""):
    actual, expected = actual.float(), expected.float()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual - expected).abs()
    bound = rtol * (expected.abs() + scale)
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{what}: max error {err.max().item():.3g} exceeds rtol {rtol} (scale {scale:.3g})"


def _load(builder):
    why = "DSPLUG_DISABLE_NATIVE_OPS is set" if native_disabled() else builder.incompatibility()
    if why:
        pytest.skip(f"native op {builder.NAME} cannot be built here: {why}")
    return builder.load(fallback=False)


@pytest.fixture(scope="module")
def native():
    """The native ops, built once (into the default cache, or $DSPLUG_OPS_CACHE)."""
    return {"adam": _load(CPUAdamBuilder()), "adagrad": _load(CPUAdagradBuilder()), "lion": _load(CPULionBuilder())}


@pytest.fixture(scope="module")
def scalar_adam():
    """cpu_adam compiled for the portable scalar path (DSPLUG_OPS_ISA=scalar)."""
    return _load(CPUAdamBuilder(isa="scalar"))


FALLBACK = {"adam": AdamKernel(None), "adagrad": AdagradKernel(None), "lion": LionKernel(None)}

sizes = st.one_of(st.integers(1, 70), st.sampled_from([7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 257, 1023, 4099]))


def lion_reference(p, g, m, lr, beta1, beta2, wd):
    """Lion (Chen et al. 2023) written from the paper's update rule."""
    c = torch.mul(m, beta1) + torch.mul(g, 1 - beta1)
    p = p * (1 - lr * wd) - lr * torch.sign(c)
    m = torch.mul(m, beta2) + torch.mul(g, 1 - beta2)
    return p, m


# --------------------------------------------------------------------------- kernels vs torch.optim
@HYPOTHESIS
@given(n=sizes, steps=st.integers(1, 20), lr=st.floats(1e-4, 0.1), beta1=st.floats(0.0, 0.99),
       beta2=st.floats(0.9, 0.9999), eps=st.sampled_from([1e-8, 1e-6, 1e-3]), wd=st.sampled_from([0.0, 0.01, 0.3]),
       adamw=st.booleans(), seed=st.integers(0, 2**16))
def test_adam_matches_torch(native, n, steps, lr, beta1, beta2, eps, wd, adamw, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        native["adam"].adam_update(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                                   bias_correction=True, adamw_mode=adamw)
    assert_rel(p, ref.detach(), what="param")
    assert_rel(v, opt.state[ref]["exp_avg_sq"], what="exp_avg_sq")
    assert_rel(m, opt.state[ref]["exp_avg"], rtol=1e-5, what="exp_avg")


@HYPOTHESIS
@given(n=sizes, steps=st.integers(1, 12), lr=st.floats(1e-3, 0.5), wd=st.sampled_from([0.0, 0.05]),
       lr_decay=st.sampled_from([0.0, 0.01]), eps=st.sampled_from([1e-10, 1e-6]), seed=st.integers(0, 2**16))
def test_adagrad_matches_torch(native, n, steps, lr, wd, lr_decay, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.Adagrad([ref], lr=lr, lr_decay=lr_decay, weight_decay=wd, eps=eps)
    s = torch.zeros(n)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        native["adagrad"].adagrad_update(p, g, s, step=step, lr=lr, eps=eps, weight_decay=wd, lr_decay=lr_decay)
    assert_rel(p, ref.detach(), what="param")
    assert_rel(s, opt.state[ref]["sum"], what="sum")


@HYPOTHESIS
@given(n=sizes, steps=st.integers(1, 12), lr=st.floats(1e-4, 0.1), beta1=st.floats(0.5, 0.99),
       beta2=st.floats(0.9, 0.999), wd=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**16))
def test_lion_matches_reference_formula(native, n, steps, lr, beta1, beta2, wd, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    ref_p, ref_m = p.clone(), torch.zeros(n)
    m = torch.zeros(n)
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        ref_p, ref_m = lion_reference(ref_p, g, ref_m, lr, beta1, beta2, wd)
        native["lion"].lion_update(p, g, m, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd)
    assert_rel(p, ref_p, what="param")
    assert_rel(m, ref_m, what="exp_avg")


def test_adam_without_bias_correction_matches_formula(native):
    """bias_correction=False: p -= lr * m / (sqrt(v) + eps), checked against the closed form."""
    gen = torch.Generator().manual_seed(3)
    n, lr, b1, b2, eps = 1001, 0.01, 0.9, 0.99, 1e-8
    p = torch.randn(n, generator=gen)
    ref, m, v = p.double().clone(), torch.zeros(n), torch.zeros(n)
    rm, rv = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen)
        rm = b1 * rm + (1 - b1) * g.double()
        rv = b2 * rv + (1 - b2) * g.double() ** 2
        ref = ref - lr * rm / (rv.sqrt() + eps)
        native["adam"].adam_update(p, g, m, v, step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, bias_correction=False)
    assert_rel(p, ref, rtol=2e-6, what="param")


# --------------------------------------------------------------------------- native == fallback
@pytest.mark.parametrize("n", [1, 5, 8, 33, 100_003])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_equals_fallback(native, n, threads):
    gen = torch.Generator().manual_seed(n + threads)
    base = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    results = {}
    for name, kernels in (("native", native), ("fallback", FALLBACK)):
        pa, ma, va = base.clone(), torch.zeros(n), torch.zeros(n)
        pg, sg = base.clone(), torch.zeros(n)
        pl, ml = base.clone(), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads, 1):
            kernels["adam"].adam_update(pa, g, ma, va, step=step, lr=1e-2, weight_decay=0.1, out=out, num_threads=threads)
            kernels["adagrad"].adagrad_update(pg, g, sg, step=step, lr=1e-2, weight_decay=0.1, num_threads=threads)
            kernels["lion"].lion_update(pl, g, ml, lr=1e-3, weight_decay=0.1, num_threads=threads)
        results[name] = (pa, ma, va, pg, sg, pl, ml, out)
    for what, a, b in zip(("adam p", "adam m", "adam v", "adagrad p", "adagrad sum", "lion p", "lion m"),
                          results["native"], results["fallback"]):
        assert_rel(a, b, rtol=1e-6 if "m" not in what.split()[-1] else 1e-5, what=what)
    torch.testing.assert_close(results["native"][-1], results["fallback"][0].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 33, 1000])
def test_simd_path_equals_scalar_path(native, scalar_adam, n):
    """The AVX path (with its scalar tail) agrees with the all-scalar build, incl. bf16/fp16 stores."""
    assert scalar_adam.isa == "scalar"
    gen = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=gen) * 3
    outs = {}
    for name, kernel in (("simd", native["adam"]), ("scalar", scalar_adam)):
        p, m, v = base.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        o16, obf = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            g = torch.randn(n, generator=gen.manual_seed(step))
            kernel.adam_update(p, g, m, v, step=step, lr=1e-2, out=o16 if step % 2 else obf)
        outs[name] = (p, m, v, o16, obf)
    for a, b in zip(outs["simd"], outs["scalar"]):
        assert_rel(a, b, rtol=1e-6)


# --------------------------------------------------------------------------- output copy, bf16 moments
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40_000, 100_001])
def test_output_copy_equals_param_to_dtype(native, scalar_adam, dtype, n):
    gen = torch.Generator().manual_seed(n)
    for kernel in (native["adam"], scalar_adam, FALLBACK["adam"]):
        # wide dynamic range: subnormal halves, overflow to inf, ties
        p = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 6)
        g = torch.randn(n, generator=gen)
        m, v, out = torch.zeros(n), torch.zeros(n), torch.full((n,), 7.0, dtype=dtype)
        kernel.adam_update(p, g, m, v, step=1, lr=1e-3, out=out, num_threads=2)
        assert torch.equal(out, p.to(dtype)), f"{kernel}: out != param.to({dtype})"
    for name in ("adagrad", "lion"):
        p, g, s, out = torch.randn(n), torch.randn(n), torch.zeros(n), torch.empty(n, dtype=dtype)
        if name == "adagrad":
            native[name].adagrad_update(p, g, s, step=1, lr=1e-2, out=out)
        else:
            native[name].lion_update(p, g, s, lr=1e-2, out=out)
        assert torch.equal(out, p.to(dtype))


def test_bf16_rounding_is_nearest_even(native, scalar_adam):
    """Stores of values exactly halfway between two bf16 numbers round to the even one."""
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125 -> 1.0 (even); 1 + 3*2^-8 -> 1.015625
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0, float("inf")] * 5)
    for kernel in (native["adam"], scalar_adam):
        p = halfway.clone()
        out = torch.empty_like(p, dtype=torch.bfloat16)
        # lr=0 and no decay: the param is unchanged, so out is exactly its bf16 rounding
        kernel.adam_update(p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=0.0, out=out)
        assert torch.equal(out, halfway.to(torch.bfloat16))
        assert out[0].item() == 1.0 and out[1].item() == 1.015625


BF16_MOMENT_TOL = 0.01  # max |p_bf16 - p_fp32| <= 1% of lr * steps (the most Adam can move a param)


@pytest.mark.parametrize("n", [9, 4097])
def test_bf16_moments_stay_within_stated_tolerance(native, n):
    gen = torch.Generator().manual_seed(n)
    lr, steps = 1e-2, 40
    p32 = torch.randn(n, generator=gen)
    p16 = p32.clone()
    m32, v32 = torch.zeros(n), torch.zeros(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * (1 + 0.1 * step)
        native["adam"].adam_update(p32, g, m32, v32, step=step, lr=lr, weight_decay=0.01)
        native["adam"].adam_update(p16, g, m16, v16, step=step, lr=lr, weight_decay=0.01)
    drift = (p16 - p32).abs().max().item()
    assert drift <= BF16_MOMENT_TOL * lr * steps, drift
    assert drift > 0  # the option really stores bf16 (else this test proves nothing)
    assert_rel(m16.float(), m32, rtol=2**-7, what="bf16 exp_avg vs fp32")


@pytest.mark.parametrize("param_dtype,state_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.float16, torch.float32), (torch.float16, torch.float16)])
def test_half_precision_params_native_equals_fallback(native, param_dtype, state_dtype):
    gen = torch.Generator().manual_seed(11)
    n = 1037
    base = torch.randn(n, generator=gen).to(param_dtype)
    res = []
    for kernels in (native, FALLBACK):
        p, m, v = base.clone(), torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
        for step in range(1, 4):
            g = torch.randn(n, generator=gen.manual_seed(step)).to(param_dtype)
            kernels["adam"].adam_update(p, g, m, v, step=step, lr=1e-2)
        res.append((p, m, v))
    for a, b in zip(*res):
        # one rounding of the fp32 result to the 8/11-bit mantissa may differ by one unit
        assert_rel(a, b, rtol=2**-7 if torch.bfloat16 in (a.dtype, param_dtype) else 2**-10)


# --------------------------------------------------------------------------- argument errors
def test_kernel_errors_name_the_argument(native):
    adam = native["adam"]
    p, g, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="grad has 7 elements but param has 8"):
        adam.adam_update(p, torch.zeros(7), m, v, step=1, lr=0.1)
    with pytest.raises(ValueError, match="exp_avg_sq must be contiguous"):
        adam.adam_update(p, g, m, torch.zeros(8, 2)[:, 0], step=1, lr=0.1)
    with pytest.raises(TypeError, match="param has dtype float64; expected float32, bfloat16, float16"):
        adam.adam_update(p.double(), g.double(), m, v, step=1, lr=0.1)
    with pytest.raises(TypeError, match="exp_avg has dtype bfloat16 but .*exp_avg_sq|exp_avg_sq has dtype"):
        adam.adam_update(p, g, m.bfloat16(), v, step=1, lr=0.1)
    with pytest.raises(ValueError, match="out has 4 elements but param has 8"):
        adam.adam_update(p, g, m, v, step=1, lr=0.1, out=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor, got list"):
        adam.adam_update(p, [0.0] * 8, m, v, step=1, lr=0.1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam.adam_update(p, g, m, v, step=0, lr=0.1)
    with pytest.raises(TypeError, match="state_sum has dtype float16; expected float32, bfloat16"):
        native["adagrad"].adagrad_update(p, g, torch.zeros(8, dtype=torch.float16), step=1, lr=0.1)
    with pytest.raises(ValueError, match="param must be on the CPU, got device meta"):
        adam.adam_update(torch.zeros(8, device="meta"), g, m, v, step=1, lr=0.1)


# --------------------------------------------------------------------------- optimizer classes
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))


def _train(opt, model, steps=5, seed=1, **step_kwargs):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 13, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step(**step_kwargs)


@pytest.mark.parametrize("adamw", [True, False])
def test_deepspeed_cpu_adam_trains_like_torch(native, adamw):
    from dsplug.ops.adam import CPUAdam, DeepSpeedCPUAdam

    assert CPUAdam is DeepSpeedCPUAdam
    a, b = _model(), _model()
    ours = DeepSpeedCPUAdam(a.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(b.parameters(), lr=1e-2, weight_decay=0.05)
    assert ours.op.is_native
    _train(ours, a)
    _train(ref, b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel(pa.detach(), pb.detach())


def test_deepspeed_cpu_adagrad_and_lion_train_like_references(native):
    from dsplug.ops.adagrad import DeepSpeedCPUAdagrad
    from dsplug.ops.lion import DeepSpeedCPULion

    a, b = _model(), _model()
    _train(DeepSpeedCPUAdagrad(a.parameters(), lr=1e-2, weight_decay=0.01), a)
    _train(torch.optim.Adagrad(b.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-10), b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel(pa.detach(), pb.detach())

    c = _model()
    before = [p.detach().clone() for p in c.parameters()]
    lion = DeepSpeedCPULion(c.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    _train(lion, c, steps=1)
    for p0, p in zip(before, c.parameters()):  # first step: m = 0 -> update = sign(g)
        expected = p0 * (1 - 1e-3 * 0.1) - 1e-3 * torch.sign(p.grad)
        assert_rel(p.detach(), expected)


def test_fp16_param_groups_receive_the_updated_params(native):
    from dsplug.ops.adam import DeepSpeedCPUAdam

    model = _model()
    opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-2)
    copies = [torch.zeros(p.shape, dtype=torch.float16) for p in model.parameters()]
    _train(opt, model, steps=2, fp16_param_groups=copies)  # a list of tensors: one group
    for p, c in zip(model.parameters(), copies):
        assert torch.equal(c, p.detach().to(torch.float16))
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\] has 1 tensor\(s\) but param group 0 has 4"):
        opt.step(fp16_param_groups=[[copies[0]]])
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\]\[0\]: out has 17 elements but param has 221"):
        opt.step(fp16_param_groups=[[copies[0].view(-1)[:17].clone(), copies[1], copies[2], copies[3]]])


@pytest.mark.parametrize("moment_dtype", [None, "bf16"])
def test_state_dict_round_trip(native, moment_dtype):
    from dsplug.ops.adam import DeepSpeedCPUAdam

    a, b = _model(), _model()
    opt_a = DeepSpeedCPUAdam(a.parameters(), lr=1e-2, moment_dtype=moment_dtype)
    _train(opt_a, a, steps=3)
    sd = copy.deepcopy(opt_a.state_dict())  # as loaded from a checkpoint (torch shares tensors otherwise)
    b.load_state_dict(a.state_dict())
    opt_b = DeepSpeedCPUAdam(b.parameters(), lr=5.0, moment_dtype=moment_dtype)
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == 1e-2
    want = torch.bfloat16 if moment_dtype else torch.float32
    for p in b.parameters():
        assert opt_b.state[p]["exp_avg"].dtype == want and opt_b.state[p]["step"] == 3
    _train(opt_a, a, steps=2, seed=9)
    _train(opt_b, b, steps=2, seed=9)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_adagrad_loads_torch_state_dict(native):
    from dsplug.ops.adagrad import DeepSpeedCPUAdagrad

    a, b = _model(), _model()
    ref = torch.optim.Adagrad(a.parameters(), lr=1e-2, eps=1e-10)
    _train(ref, a, steps=2)
    b.load_state_dict(a.state_dict())
    ours = DeepSpeedCPUAdagrad(b.parameters(), lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch's 'sum' becomes 'exp_avg_sq'
    _train(ref, a, steps=2, seed=5)
    _train(ours, b, steps=2, seed=5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel(pb.detach(), pa.detach())


def test_optimizer_argument_errors(native):
    from dsplug.ops.adam import DeepSpeedCPUAdam

    params = list(_model().parameters())
    with pytest.raises(ValueError, match="does not support amsgrad"):
        DeepSpeedCPUAdam(params, amsgrad=True)
    with pytest.raises(ValueError, match=r"invalid betas\[1\]: 1.5"):
        DeepSpeedCPUAdam(params, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="moment_dtype='fp8' is not supported"):
        DeepSpeedCPUAdam(params, moment_dtype="fp8")
    with pytest.raises(ValueError, match="num_threads must be a positive integer"):
        DeepSpeedCPUAdam(params, num_threads=0)
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    meta.grad = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is on meta"):
        DeepSpeedCPUAdam([meta]).step()


def test_disable_env_forces_fallback_with_one_warning(native, monkeypatch):
    """DSPLUG_DISABLE_NATIVE_OPS=1: every op falls back, one warning in all, same results."""
    from dsplug.op_builder import builder as builder_mod
    from dsplug.ops.adam import DeepSpeedCPUAdam
    from dsplug.ops.lion import DeepSpeedCPULion

    monkeypatch.setenv("DSPLUG_DISABLE_NATIVE_OPS", "1")
    monkeypatch.setattr(builder_mod, "_WARNED", set())
    a, b = _model(), _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slow = DeepSpeedCPUAdam(a.parameters(), lr=1e-2)
        DeepSpeedCPULion(_model().parameters())
    ours = [w for w in caught if issubclass(w.category, NativeOpsFallbackWarning)]
    assert len(ours) == 1 and "DSPLUG_DISABLE_NATIVE_OPS=1" in str(ours[0].message)
    assert not slow.op.is_native
    monkeypatch.delenv("DSPLUG_DISABLE_NATIVE_OPS")
    fast = DeepSpeedCPUAdam(b.parameters(), lr=1e-2)
    assert fast.op.is_native
    _train(slow, a)
    _train(fast, b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_rel(pa.detach(), pb.detach())


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_fallback_adam_matches_torch_optim(adamw, moments):
    """The fallback takes torch's fused kernel for fp32 tensors and the element-wise path otherwise;
    both follow torch.optim.AdamW / Adam."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(5)]
    p, m, v = base.clone(), torch.zeros(1000, dtype=moments), torch.zeros(1000, dtype=moments)
    ref = torch.nn.Parameter(base.clone())
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for step, g in enumerate(grads, 1):
        FALLBACK["adam"].adam_update(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
        ref.grad = g.clone()
        opt.step()
    assert_rel(p, ref.detach(), rtol=1e-6 if moments == torch.float32 else 2e-3, what="fallback vs torch.optim")


@pytest.mark.parametrize("lr_decay", [0.0, 0.1])
def test_adagrad_sparse_gradients_update_like_torchs_sparse_adagrad(native, lr_decay):
    """nn.Embedding(sparse=True) gives sparse gradients: only the rows looked up change, by torch's
    sparse Adagrad; rows never looked up keep their values and accumulators."""
    from dsplug.ops.adagrad import DeepSpeedCPUAdagrad

    torch.manual_seed(0)
    a = torch.nn.Embedding(40, 8, sparse=True)
    b = copy.deepcopy(a)
    ours = DeepSpeedCPUAdagrad(a.parameters(), lr=0.1, lr_decay=lr_decay)
    ref = torch.optim.Adagrad(b.parameters(), lr=0.1, lr_decay=lr_decay, eps=1e-10)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, 20, (6,), generator=generator)  # rows 20-39 never looked up; repeats add up
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            (model(ids) ** 2).sum().backward()
            assert model.weight.grad.is_sparse
            opt.step()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.state[a.weight]["exp_avg_sq"], ref.state[b.weight]["sum"], rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    initial = torch.nn.Embedding(40, 8, sparse=True).weight
    assert torch.equal(a.weight[20:], initial[20:]) and not torch.equal(a.weight[:20], initial[:20])


def test_adagrad_sparse_gradient_with_weight_decay_is_refused_naming_it(native):
    from dsplug.ops.adagrad import DeepSpeedCPUAdagrad

    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = DeepSpeedCPUAdagrad(emb.parameters(), lr=0.1, weight_decay=0.01)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\]: weight_decay=0.01 does not apply to a "
                                         "sparse gradient"):
        opt.step()


def test_adam_still_refuses_sparse_gradients(native):
    from dsplug.ops.adam import DeepSpeedCPUAdam

    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = DeepSpeedCPUAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="does not support sparse gradients"):
        opt.step()


# --------------------------------------------------------------------------- whose threads run it
TEAM_N = 200_003  # several chunks of 2**15: the kernels run in parallel


def _team_buffers():
    gen = torch.Generator().manual_seed(11)
    base, grad = torch.randn(TEAM_N, generator=gen), torch.randn(TEAM_N, generator=gen)
    return base, grad, torch.zeros(TEAM_N), torch.zeros(TEAM_N)


def _adam_steps(kernel, p, grad, m, v, threads):
    """Two steps in place; the bytes of the result, read without a torch op (a forked child must
    not run torch's parallel ops: they hang there)."""
    for step in (1, 2):
        kernel.adam_update(p, grad, m, v, step=step, lr=1e-2, weight_decay=0.1, num_threads=threads)
    return b"".join(t.numpy().tobytes() for t in (p, m, v))


def _in_forked_child(conn, buffers, threads):
    kernel = CPUAdamBuilder().load(fallback=False)
    conn.send((kernel.threads, _adam_steps(kernel, *buffers, threads)))
    conn.close()


def test_kernels_run_on_torchs_openmp_team_and_on_own_threads_after_fork(native):
    """The kernels borrow torch's OpenMP thread team when torch has one (csrc/includes/
    dsplug_omp_team.h); a child forked after that team ran uses the op's own threads instead,
    where torch's own parallel ops would hang, and computes the same bytes."""
    import multiprocessing

    from tests.conftest import scaled

    adam = native["adam"]
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch here is not built with OpenMP")
    assert adam.threads.startswith("openmp team (") and "omp" in adam.threads
    mine = _team_buffers()
    theirs = tuple(t.clone() for t in mine)  # parallel torch ops: the team exists before the fork
    on_team = _adam_steps(adam, *mine, 2)
    fork = multiprocessing.get_context("fork")
    reader, writer = fork.Pipe(duplex=False)
    child = fork.Process(target=_in_forked_child, args=(writer, theirs, 2))
    child.start()
    writer.close()
    try:
        assert reader.poll(scaled(60)), "the kernel did not finish in a forked child"
        threads, forked = reader.recv()
    finally:
        child.join(scaled(10))
        if child.is_alive():
            child.kill()
    assert threads == "own threads"
    assert forked == on_team


# --------------------------------------------------------------------------- ZeRO-3 sub-groups
@pytest.mark.parametrize("adamw", [True, False])
def test_step_subgroup_equals_step_and_rollback_undoes_it(native, adamw):
    """DeepSpeed's step_subgroup / rollback_subgroup: a sub-group's flat partition steps with its
    state under the sub-group id (the same bytes as step() keeping it under the parameter), and a
    rollback recomputes the parameter and moments before that step from the same gradient."""
    from dsplug.ops.adam import DeepSpeedCPUAdam

    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(3)]
    hyper = dict(lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
    by_param, by_group = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    plain, grouped = DeepSpeedCPUAdam([by_param], **hyper), DeepSpeedCPUAdam([by_group], **hyper)
    history = []
    for g in grads:
        by_param.grad, by_group.grad = g.clone(), g.clone()
        state = grouped.state.get(7)
        history.append((by_group.detach().clone(), *(state[k].clone() for k in ("exp_avg", "exp_avg_sq"))) if state
                       else (by_group.detach().clone(), torch.zeros(1000), torch.zeros(1000)))
        plain.step()
        grouped.step_subgroup(7)
        assert torch.equal(by_group, by_param) and grouped.state[7]["step"] == plain.state[by_param]["step"]
        assert torch.equal(grouped.state[7]["exp_avg_sq"], plain.state[by_param]["exp_avg_sq"])
    assert list(grouped.state) == [7]
    for k in reversed(range(len(grads))):  # each rollback needs the gradient of the step it undoes
        by_group.grad = grads[k].clone()
        grouped.rollback_subgroup(7)
        want_p, want_m, want_v = history[k]
        assert grouped.state[7]["step"] == k
        if k == len(grads) - 1:  # undoing the last step: exact up to fp32 rounding
            assert_rel(by_group.detach(), want_p, rtol=1e-6, what="param before the last step")
            assert_rel(grouped.state[7]["exp_avg"], want_m, rtol=1e-5, what="exp_avg before the last step")
            assert_rel(grouped.state[7]["exp_avg_sq"], want_v, rtol=1e-5, what="exp_avg_sq before the last step")
        else:  # further back, exp_avg_sq of near-zero gradients is recovered by cancellation: within lr
            torch.testing.assert_close(by_group.detach(), want_p, rtol=0, atol=hyper["lr"])
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 7: step count is 0"):
        grouped.rollback_subgroup(7)
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 8"):
        grouped.rollback_subgroup(8)
    two = DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))])
    for p in two.param_groups[0]["params"]:
        p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="exactly one parameter with a gradient .* they hold 2"):
        two.step_subgroup(0)
