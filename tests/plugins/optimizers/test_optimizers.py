"""The optimizer plugins against independent references (torch.optim, formulas written here)."""
from __future__ import annotations

import copy
import inspect
import math
import types
from typing import Union

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsplug.config.params import options_of
from dsplug.config.schema import ConfigError, Report, parse
from dsplug.context import BuildContext
from dsplug.plugins.optimizers import adam_optimizer, torch_optim, torch_signatures
from dsplug.plugins.optimizers.adam_optimizer import FusedAdam
from dsplug.plugins.optimizers.adagrad import AdagradParams
from dsplug.plugins.optimizers.lamb_optimizer import FusedLamb
from dsplug.plugins.optimizers.sgd import SGDParams
from dsplug.registry import get_registry

FAST = settings(max_examples=12, deadline=None)


@pytest.fixture(scope="module")
def registry():
    return get_registry(refresh=True)


def spec_of(name):
    return get_registry().get("optimizer", name, what="optimizer.type").spec


def build(type_name, params_dict, model_params):
    """What the engine does: select by optimizer.type, parse optimizer.params, call the factory."""
    spec = spec_of(type_name)
    config = parse(spec.schema, params_dict, "optimizer.params")
    return spec.factory(model_params, config, BuildContext())


def config_error(type_name, params_dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse(spec_of(type_name).schema, params_dict, "optimizer.params")
    return str(info.value)


# ----------------------------------------------------------------------------- model helpers
def random_model(seed: int, widths):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def clone_params(model):
    return [p.detach().clone().requires_grad_(True) for p in model.parameters()]


def train(optimizer, params, model, steps: int, seed: int, skip_last_on_odd_steps: bool = False):
    """Drive ``optimizer`` with the gradients ``model``'s loss gives at ``params`` (reproducible)."""
    gen = torch.Generator().manual_seed(seed)
    template = list(model.parameters())
    for step in range(steps):
        x = torch.randn(8, template[0].shape[1], generator=gen)
        y = torch.randn(8, template[-1].shape[0], generator=gen)
        out = torch.func.functional_call(model, {n: p for (n, _), p in zip(model.named_parameters(), params)}, (x,))
        loss = torch.nn.functional.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()
        if skip_last_on_odd_steps and step % 2 == 1:
            params[-1].grad = None  # a parameter without a gradient this step keeps its own count
        optimizer.step()
    return params


def assert_params_close(actual, expected, rtol=1e-6, atol=5e-7):  # atol: a few fp32 ulps near 1
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach(), e.detach().to(a.dtype), rtol=rtol, atol=atol)


widths_st = st.lists(st.integers(1, 12), min_size=2, max_size=4)


# ----------------------------------------------------------------------------- Adam / AdamW
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("torch_adam", [False, True])
@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    widths=widths_st,
    lr=st.floats(1e-4, 5e-2),
    wd=st.sampled_from([0.0, 0.1, 0.5]),
    betas=st.tuples(st.floats(0.5, 0.95), st.floats(0.9, 0.9999)),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
)
def test_adam_matches_torch(seed, widths, lr, wd, betas, eps, adam_w_mode, torch_adam):
    model = random_model(seed, widths)
    ours = clone_params(model)
    theirs = clone_params(model)
    opt = build("Adam", dict(lr=lr, weight_decay=wd, betas=list(betas), eps=eps,
                             adam_w_mode=adam_w_mode, torch_adam=torch_adam), ours)
    expected_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    if torch_adam:
        assert type(opt) is expected_cls
    else:  # CPU fp32 parameters step through the native cpu_adam op when it can be built
        assert type(opt) is FusedAdam
    reference = expected_cls(theirs, lr=lr, weight_decay=wd, betas=betas, eps=eps, foreach=False)
    train(opt, ours, model, 15, seed, skip_last_on_odd_steps=True)
    train(reference, theirs, model, 15, seed, skip_last_on_odd_steps=True)
    assert_params_close(ours, theirs)


@pytest.mark.parametrize("torch_adam", [False, True])
def test_adamw_type_matches_torch_adamw_with_param_groups(registry, torch_adam):
    model = random_model(3, [6, 9, 4])
    ours, theirs = clone_params(model), clone_params(model)
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.5}, {"params": ps[2:], "lr": 3e-3}]  # noqa: E731
    opt = build("adamw", {"lr": 1e-2, "weight_decay": 0.05, "torch_adam": torch_adam}, groups(ours))
    reference = torch.optim.AdamW(groups(theirs), lr=1e-2, weight_decay=0.05)
    train(opt, ours, model, 25, 7)
    train(reference, theirs, model, 25, 7)
    assert_params_close(ours, theirs)


def reference_adam(params, grad_steps, lr, betas, eps, wd, decoupled, bias_correction):
    """Adam written out per tensor in float64 (L2: g + wd·p before the moments)."""
    b1, b2 = betas
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grad_steps, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            if not decoupled:
                g = g + wd * params[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            bc1 = 1 - b1**t if bias_correction else 1.0
            bc2 = 1 - b2**t if bias_correction else 1.0
            if decoupled:
                params[i] = params[i] * (1 - lr * wd)
            params[i] = params[i] - lr * (m[i] / bc1) / (torch.sqrt(v[i] / bc2) + eps)
    return params


def random_grad_steps(params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


def run_with_grads(optimizer, params, grad_steps):
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    return params


@FAST
@given(seed=st.integers(0, 2**16), decoupled=st.booleans(), bias_correction=st.booleans(),
       wd=st.sampled_from([0.0, 0.1, 1.0]))
def test_adam_matches_handwritten_reference(seed, decoupled, bias_correction, wd):
    torch.manual_seed(seed)
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(1)]
    grads = random_grad_steps(params, 20, seed)
    hyper = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, wd=wd, decoupled=decoupled, bias_correction=bias_correction)
    expected = reference_adam(params, grads, **hyper)
    ours = [p.clone() for p in params]
    opt = build("Adam", {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": wd,
                         "adam_w_mode": decoupled, "bias_correction": bias_correction}, ours)
    run_with_grads(opt, ours, grads)
    assert_params_close(ours, expected, rtol=1e-5, atol=1e-6)


def fast_and_foreach_runs(adam_w_mode: bool, steps: int, seed: int):
    """FusedAdam's fast path (use_fused_kernel) and its foreach path on the same gradients: the two
    resulting parameter lists."""
    params = [torch.randn(33, 17), torch.randn(17), torch.randn(3, 3, 3)]
    grads = random_grad_steps(params, steps, seed)
    results = []
    for fast in (True, False):
        ours = [p.clone() for p in params]
        opt = FusedAdam(ours, lr=5e-3, weight_decay=0.2, adam_w_mode=adam_w_mode, betas=(0.8, 0.95))
        opt.use_fused_kernel = fast
        results.append(run_with_grads(opt, ours, grads))
    return results


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_kernel_path_equals_foreach_path(monkeypatch, adam_w_mode):
    """Invariant: the fast path (torch's fused kernel) computes what the readable foreach path does."""
    if not adam_optimizer.fused_kernel_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no fused Adam kernel for CPU")
    monkeypatch.setenv("DSPLUG_DISABLE_NATIVE_OPS", "1")  # else CPU fp32 steps take the native op
    calls = []
    real = adam_optimizer.fused_adam_step
    monkeypatch.setattr(adam_optimizer, "fused_adam_step", lambda *a: calls.append(1) or real(*a))
    results = fast_and_foreach_runs(adam_w_mode, 30, 8)
    assert len(calls) == 30  # the fused run took the fast path, the other did not
    assert_params_close(results[0], results[1])


def test_l2_and_decoupled_modes_differ():
    """With weight decay the two modes must give different results (the switch is live)."""
    params = [torch.randn(4, 4)]
    grads = random_grad_steps(params, 5, 0)
    results = []
    for mode in (True, False):
        ours = [p.clone() for p in params]
        run_with_grads(build("Adam", {"weight_decay": 0.5, "lr": 0.1, "adam_w_mode": mode}, ours), ours, grads)
        results.append(ours[0])
    assert not torch.allclose(results[0], results[1])


def test_adam_defaults_are_fused_adam_defaults():
    opt = build("Adam", {}, [torch.zeros(2, requires_grad=True)])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert group["bias_correction"] is True and group["adam_w_mode"] is True and opt.set_grad_none is True


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_steps_cpu_fp32_parameters_through_the_native_op(monkeypatch, adam_w_mode):
    """"type": "Adam" / "AdamW" build FusedAdam (as DeepSpeed does) on CPU parameters too; its CPU
    fp32 steps go through the native cpu_adam op and compute what the foreach path does."""
    from dsplug.op_builder import op_status

    if not op_status("cpu_adam").compatible:
        pytest.skip("no C++ toolchain: the native op cannot be built here")
    opt = build("AdamW", {"lr": 0.01, "weight_decay": 0.1}, [torch.zeros(2, requires_grad=True)])
    assert type(opt) is FusedAdam and opt.adam_w_mode is True
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.9, 0.999), 1e-8, 0.1)
    calls = []
    real = adam_optimizer._native_step
    monkeypatch.setattr(adam_optimizer, "_native_step", lambda *a: calls.append(real(*a)) or calls[-1])
    results = fast_and_foreach_runs(adam_w_mode, 12, 5)
    assert calls == [True] * 12  # the fast run stepped through the op, the other did not ask
    assert_params_close(results[0], results[1])


def test_fused_adam_without_the_native_op_takes_torchs_kernels(monkeypatch):
    monkeypatch.setenv("DSPLUG_DISABLE_NATIVE_OPS", "1")
    params = [torch.randn(5, 3)]
    grads = random_grad_steps(params, 3, 1)
    opt = build("Adam", {"lr": 0.01}, params)
    run_with_grads(opt, params, grads)
    assert type(opt) is FusedAdam and opt._native_cpu_adam() is False


def test_set_grad_none_controls_zero_grad():
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    FusedAdam([p]).zero_grad()
    assert p.grad is None
    p.grad = torch.ones(3)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert torch.equal(p.grad, torch.zeros(3))


# ----------------------------------------------------------------------------- Lamb
def reference_lamb(params, grad_steps, lr, betas, eps, wd, bias_correction, eps_inside_sqrt,
                   max_grad_norm, max_coeff, min_coeff):
    """LAMB written out per tensor in float64; returns (params, last step's trust ratios)."""
    b1, b2 = betas
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ratios = []
    for t, grads in enumerate(grad_steps, start=1):
        grads = [g.double() for g in grads]
        if max_grad_norm > 0:
            total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            clip = (total + 1e-6) / max_grad_norm
            if clip > 1:
                grads = [g / clip for g in grads]
        ratios = []
        for i, g in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            bc1 = 1 - b1**t if bias_correction else 1.0
            bc2 = 1 - b2**t if bias_correction else 1.0
            m_hat, v_hat = m[i] / bc1, v[i] / bc2
            denom = torch.sqrt(v_hat + eps) if eps_inside_sqrt else torch.sqrt(v_hat) + eps
            update = m_hat / denom + wd * params[i]
            w_norm, u_norm = float(params[i].norm()), float(update.norm())
            ratio = 1.0
            if w_norm != 0 and u_norm != 0:
                ratio = min(max(w_norm / u_norm, min_coeff), max_coeff)
            ratios.append(ratio)
            params[i] = params[i] - lr * ratio * update
    return params, ratios


@FAST
@given(
    seed=st.integers(0, 2**16),
    wd=st.sampled_from([0.0, 0.01, 0.5]),
    bias_correction=st.booleans(),
    eps_inside_sqrt=st.booleans(),
    max_grad_norm=st.sampled_from([0.0, 0.5, 100.0]),
)
def test_lamb_matches_reference_formula(seed, wd, bias_correction, eps_inside_sqrt, max_grad_norm):
    torch.manual_seed(seed)
    params = [torch.randn(6, 5), torch.randn(9) * 3, torch.randn(2, 2, 2) * 0.1]
    grads = random_grad_steps(params, 12, seed)
    hyper = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-6, wd=wd, bias_correction=bias_correction,
                 eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm, max_coeff=10.0, min_coeff=0.01)
    expected, expected_ratios = reference_lamb(params, grads, **hyper)
    ours = [p.clone() for p in params]
    opt = build("Lamb", {"lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": wd,
                         "bias_correction": bias_correction, "eps_inside_sqrt": eps_inside_sqrt,
                         "max_grad_norm": max_grad_norm}, ours)
    assert isinstance(opt, FusedLamb)
    run_with_grads(opt, ours, grads)
    assert_params_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert opt.get_lamb_coeffs() == pytest.approx(expected_ratios, rel=1e-5)


def test_lamb_trust_ratio_clipped_to_max_and_min_coeff():
    torch.manual_seed(0)
    # ||w|| / ||update||: the update of Adam is ~1 per element, so a weight of scale 1000 gives a
    # ratio ~1000 (clipped to max_coeff) and one of scale 1e-6 a ratio ~1e-6 (clipped to min_coeff).
    params = [torch.randn(16) * 1000, torch.randn(16) * 1e-6, torch.zeros(4), torch.randn(16)]
    grads = random_grad_steps(params, 3, 1)
    for step in grads:
        step[3] = torch.zeros(16)  # moments stay 0, so the update norm is 0: ratio 1
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0, bias_correction=True, eps_inside_sqrt=False,
                 max_grad_norm=0.0, max_coeff=5.0, min_coeff=0.02)
    ours = [p.clone() for p in params]
    opt = build("Lamb", {"lr": 1e-3, "max_coeff": 5.0, "min_coeff": 0.02}, ours)
    run_with_grads(opt, ours, grads[:1])
    coeffs = opt.get_lamb_coeffs()
    assert coeffs[0] == pytest.approx(5.0) and coeffs[1] == pytest.approx(0.02)
    assert coeffs[2] == 1.0 and coeffs[3] == 1.0  # zero weights; zero update
    run_with_grads(opt, ours, grads[1:])
    expected, expected_ratios = reference_lamb(params, grads, **hyper)
    assert opt.get_lamb_coeffs() == pytest.approx(expected_ratios, rel=1e-5)
    assert_params_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_lamb_max_grad_norm_clips_the_gradient():
    """With clipping the result equals running unclipped on the pre-scaled gradients."""
    params = [torch.randn(10), torch.randn(3, 3)]
    grads = random_grad_steps(params, 1, 5)
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads[0]))
    clipped = [p.clone() for p in params]
    run_with_grads(FusedLamb(clipped, lr=0.1, max_grad_norm=0.5), clipped, grads)
    scale = (total + 1e-6) / 0.5
    prescaled = [p.clone() for p in params]
    run_with_grads(FusedLamb(prescaled, lr=0.1), prescaled, [[g / scale for g in grads[0]]])
    assert_params_close(clipped, prescaled)


# ----------------------------------------------------------------------------- SGD / Adagrad / by name
@pytest.mark.parametrize(
    "type_name, params_dict, reference",
    [
        ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
         lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
        ("sgd", {}, lambda ps: torch.optim.SGD(ps, lr=1e-3)),
        ("Adagrad", {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
         lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
        ("RMSprop", {"lr": 1e-3, "alpha": 0.9, "momentum": 0.5, "centered": True},
         lambda ps: torch.optim.RMSprop(ps, lr=1e-3, alpha=0.9, momentum=0.5, centered=True)),
        ("nadam", {"lr": 2e-3, "betas": [0.8, 0.99], "momentum_decay": 0.01},
         lambda ps: torch.optim.NAdam(ps, lr=2e-3, betas=(0.8, 0.99), momentum_decay=0.01)),
        ("Rprop", {"etas": [0.4, 1.3], "step_sizes": [1e-5, 10]},
         lambda ps: torch.optim.Rprop(ps, etas=(0.4, 1.3), step_sizes=(1e-5, 10))),
    ],
)
def test_torch_semantics_optimizers_match_torch(registry, type_name, params_dict, reference):
    model = random_model(11, [5, 8, 3])
    ours, theirs = clone_params(model), clone_params(model)
    opt = build(type_name, params_dict, ours)
    ref = reference(theirs)
    assert type(opt) is type(ref)
    train(opt, ours, model, 20, 2)
    train(ref, theirs, model, 20, 2)
    assert_params_close(ours, theirs)


def test_every_torch_optimizer_is_selectable_by_name(registry):
    exported = torch_signatures.signatures_from_inspect()
    assert {"RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Adadelta", "Rprop"} <= set(exported)
    for name in exported:
        spec = registry.get("optimizer", name.upper()).spec
        assert spec.name == name
        if name not in torch_optim.NATIVE:
            assert spec.schema.__name__ == f"{name}Params"


@pytest.mark.parametrize("schema_cls, cls", [(SGDParams, torch.optim.SGD), (AdagradParams, torch.optim.Adagrad)])
def test_native_torch_schemas_follow_the_torch_signature(schema_cls, cls):
    signature = inspect.signature(cls.__init__).parameters
    defaults = options_of(parse(schema_cls, {}), cls.__name__)
    for key, value in defaults.items():
        assert key in signature, key
        assert value == signature[key].default, key
    assert set(defaults) == set(list(signature)[2:])  # every documented argument, nothing more


def test_signatures_read_from_source_equal_inspect():
    from_source = torch_signatures.signatures_from_source()
    from_inspect = torch_signatures.signatures_from_inspect()
    assert set(from_source) == set(from_inspect)
    for name, signature in from_inspect.items():
        theirs = signature.arguments
        ours = from_source[name].arguments
        assert [a.name for a in ours] == [a.name for a in theirs], name
        for a, b in zip(ours, theirs):
            assert repr(a.default) == repr(b.default), (name, a.name)
            assert torch_optim.value_type(a) == torch_optim.value_type(b), (name, a.name)


def test_derived_schema_takes_types_from_annotations_and_defaults():
    make = torch_signatures.Argument
    assert torch_optim.value_type(make("lr", "float | Tensor", 0.01)) is float
    assert torch_optim.value_type(make("weight_decay", "float", 0)) is float
    assert torch_optim.value_type(make("max_iter", "int", 20)) is int
    assert torch_optim.value_type(make("x", None, 0)) == Union[int, float]  # no annotation: the default's kind
    assert torch_optim.value_type(make("flag", None, False)) is bool
    arguments = (
        make("foreach", "bool | None", None),
        make("etas", None, (0.5, 2)),
        make("needed", None, torch_signatures.REQUIRED),
    )
    sig = torch_signatures.OptimizerSignature("Fake", arguments)
    cls = torch_optim.derive_schema(sig)
    parsed = parse(cls, {"foreach": None, "etas": [0.1, 3], "needed": "anything"})
    assert parsed.foreach is None and parsed.etas == (0.1, 3) and parsed.needed == "anything"
    assert "required key is missing" in str(pytest.raises(ConfigError, parse, cls, {}).value)
    wrong = pytest.raises(ConfigError, parse, cls, {"foreach": 2, "needed": 1})
    assert "optimizer" not in str(wrong.value) and "foreach: 2 is not valid: expected a boolean or null" in str(wrong.value)


# ----------------------------------------------------------------------------- schema errors
def test_unknown_key_gets_did_you_mean(registry):
    message = config_error("AdamW", {"lr": 1e-3, "weight_decy": 0.1})
    assert "optimizer.params.weight_decy" in message and "did you mean 'optimizer.params.weight_decay'" in message
    message = config_error("RMSprop", {"momentun": 0.9})
    assert "optimizer.params.momentun" in message and "'optimizer.params.momentum'" in message
    message = config_error("Lamb", {"max_coef": 3.0})
    assert "'optimizer.params.max_coeff'" in message


def test_wrong_types_are_reported(registry):
    message = config_error("Adam", {"lr": "fast", "betas": [0.9], "adam_w_mode": "yes"})
    assert "optimizer.params.lr: 'fast' is not valid: expected a number" in message
    assert "optimizer.params.betas" in message and "a list of 2" in message
    assert "optimizer.params.adam_w_mode" in message and "expected a boolean" in message
    message = config_error("RMSprop", {"centered": "yes", "lr": [1]})
    assert "optimizer.params.centered: 'yes' is not valid: expected a boolean" in message
    assert "optimizer.params.lr: [1] is not valid: expected a number" in message
    message = config_error("SGD", {"weight_decay": True})
    assert "optimizer.params.weight_decay: true is not valid: expected a number" in message


def test_value_ranges_are_checked(registry):
    assert "must be >= 0" in config_error("Adam", {"lr": -1})
    assert "each beta must be in [0, 1)" in config_error("Adam", {"betas": [0.9, 1.5]})
    message = config_error("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0})
    assert "optimizer.params.min_coeff" in message and "must not exceed max_coeff" in message


def test_amsgrad_refused_like_fused_adam(registry):
    message = config_error("Adam", {"amsgrad": True})
    assert "optimizer.params.amsgrad" in message and "does not support the AMSGrad variant" in message
    assert "torch_adam: true" in message
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.zeros(1)], amsgrad=True)
    assert "AMSGrad" in config_error("Lamb", {"amsgrad": True})
    # torch's Adam implements it: accepted with torch_adam
    opt = build("AdamW", {"amsgrad": True, "torch_adam": True}, [torch.zeros(2, requires_grad=True)])
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["amsgrad"] is True


def test_fused_only_switches_refused_with_torch_adam(registry):
    message = config_error("Adam", {"torch_adam": True, "bias_correction": False})
    assert "optimizer.params.bias_correction" in message and "only available in dsplug's FusedAdam" in message
    # AdamW with adam_w_mode: false is accepted with a warning, as in DeepSpeed (test below)


def test_sgd_nesterov_needs_momentum(registry):
    assert "Nesterov momentum needs momentum > 0" in config_error("SGD", {"nesterov": True})
    assert "dampening = 0" in config_error("SGD", {"nesterov": True, "momentum": 0.9, "dampening": 0.1})


def test_auto_accepted_only_where_hugging_face_sets_it(registry):
    for name in ("Adam", "AdamW", "Lamb", "RMSprop"):
        auto = {"lr": "auto", "eps": "auto", "weight_decay": "auto"}
        if name != "RMSprop":
            auto["betas"] = "auto"
        parsed = parse(spec_of(name).schema, auto, "optimizer.params")
        assert parsed.lr == "auto"
        with pytest.raises(ValueError, match=r'optimizer.params.lr.*still "auto"'):
            spec_of(name).factory([torch.zeros(1, requires_grad=True)], parsed, BuildContext())
    assert '"auto" is not accepted here' in config_error("RMSprop", {"momentum": "auto"})


def test_every_error_reported_at_once(registry):
    message = config_error("AdamW", {"lr": "x", "eps": -1, "typo_key": 1})
    assert "3 errors" in message


# ----------------------------------------------------------------------------- config rules
class FakeConfig:
    def __init__(self, optimizer_type, stage=None, allow=False, offload_device=None):
        offload = types.SimpleNamespace(device=offload_device) if offload_device else None
        self.sections = {
            "optimizer": types.SimpleNamespace(type=optimizer_type, params={}),
            "zero_optimization": (
                None if stage is None else types.SimpleNamespace(stage=stage, offload_optimizer=offload)
            ),
        }
        self.zero_allow_untested_optimizer = allow

    def get(self, name, default=None):
        return self.sections.get(name, default)


def run_rules(type_name, config):
    report = Report()
    for rule in spec_of(type_name).rules:
        rule(config, report)
    return report


def test_untested_optimizer_refused_under_zero(registry):
    report = run_rules("RMSprop", FakeConfig("rmsprop", stage=2))
    assert len(report.errors) == 1
    text = str(report.errors[0])
    assert "zero_optimization.stage" in text and "zero_allow_untested_optimizer" in text and "'rmsprop'" in text


@pytest.mark.parametrize(
    "config",
    [
        FakeConfig("RMSprop", stage=0),
        FakeConfig("RMSprop", stage=None),
        FakeConfig("RMSprop", stage=3, allow=True),
        FakeConfig("Adam", stage=3),  # the rule belongs to RMSprop: another selection is not its business
    ],
)
def test_untested_optimizer_allowed_cases(registry, config):
    assert not run_rules("RMSprop", config).errors


def test_untested_rule_covers_torch_sgd_and_adagrad_but_not_adam(registry):
    assert run_rules("SGD", FakeConfig("SGD", stage=1)).errors
    assert run_rules("Adagrad", FakeConfig("Adagrad", stage=1)).errors
    assert not run_rules("Adagrad", FakeConfig("Adagrad", stage=1, offload_device="cpu")).errors
    for name in ("Adam", "AdamW", "Lamb"):
        assert not run_rules(name, FakeConfig(name, stage=3)).errors


def test_rule_reads_plain_dict_sections(registry):
    config = types.SimpleNamespace(zero_allow_untested_optimizer=False)
    config.get = {"optimizer": {"type": "Adamax"}, "zero_optimization": {"stage": 1}}.get
    assert run_rules("Adamax", config).errors


def test_lbfgs_refused_clearly(registry):
    report = run_rules("LBFGS", FakeConfig("LBFGS"))
    assert any("closure" in str(e) for e in report.errors)
    with pytest.raises(ValueError, match="closure"):
        build("LBFGS", {}, [torch.zeros(1, requires_grad=True)])


def test_registry_miss_suggests(registry):
    with pytest.raises(LookupError, match="Did you mean 'RMSprop'"):
        registry.get("optimizer", "RMSpropp", what="optimizer.type")


# ----------------------------------------------------------------------------- state dict
@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False, bias_correction=False),
    lambda ps: FusedLamb(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
])
def test_state_dict_round_trip(make):
    params = [torch.randn(4, 3), torch.randn(5)]
    grads = random_grad_steps(params, 10, 9)
    straight = [p.clone() for p in params]
    run_with_grads(make(straight), straight, grads)

    first = [p.clone() for p in params]
    opt = make(first)
    run_with_grads(opt, first, grads[:4])
    saved = opt.state_dict()
    resumed = [p.clone() for p in first]
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    assert opt2.state_dict()["state"][0]["step"] == 4
    # the reloaded groups hold the same keys as the saved ones (no torch bookkeeping such as 'differentiable')
    assert [set(g) for g in opt2.state_dict()["param_groups"]] == [set(g) for g in saved["param_groups"]]
    run_with_grads(opt2, resumed, grads[4:])
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


def test_torch_adamw_state_loads_into_fused_adam():
    """Same state keys as torch.optim.AdamW: a run can switch implementations mid-way."""
    params = [torch.randn(6)]
    grads = random_grad_steps(params, 8, 4)
    theirs = [p.clone() for p in params]
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    run_with_grads(reference, theirs, grads[:3])
    ours = [p.clone() for p in theirs]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(reference.state_dict()))  # load may alias same-dtype tensors
    run_with_grads(reference, theirs, grads[3:])
    run_with_grads(opt, ours, grads[3:])
    assert_params_close(ours, theirs)


def test_adamw_accepts_adam_w_mode_false_with_a_warning_and_still_decouples():
    """DeepSpeed accepts AdamW with adam_w_mode: false (AdamW always decouples); so does dsplug, saying so."""
    import dsplug
    from dsplug.config import DsplugConfig

    with pytest.warns(Warning, match="adam_w_mode.*AdamW always decouples weight decay"):
        DsplugConfig({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5))]
    ref = [torch.nn.Parameter(ours[0].detach().clone())]
    opt = build("AdamW", {"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False, "set_grad_none": False}, ours)
    torch_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.5)
    for _ in range(3):
        g = torch.randn(5)
        ours[0].grad, ref[0].grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    torch.testing.assert_close(ours[0].detach(), ref[0].detach())
    assert getattr(opt, "adam_w_mode", True) is True
