"""Flops profiler counting and output, checked against closed-form FLOP / MAC formulas.

Conventions under test (DeepSpeed's): 1 MAC = 2 FLOPs; Linear counts no FLOPs for its bias;
Conv counts one FLOP per output element for its bias; activations, softmax, pooling and
torch.add / torch.mul count one FLOP per element; LayerNorm / GroupNorm / InstanceNorm and
training-mode BatchNorm count 5 FLOPs per element with an affine weight (4 without);
embedding lookups count nothing.
"""
from __future__ import annotations

import ast
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsplug.plugins.profilers.flops_profiler.patching import _targets
from dsplug.profiling.flops_profiler import (FlopsProfiler, duration_to_string, flops_to_string,
                                             get_model_profile, get_module_flops, get_module_macs,
                                             macs_to_string, number_to_string, params_to_string)


def profile(model, *args, **kwargs):
    """(flops, macs, params) of one forward call, as numbers."""
    return get_model_profile(model, args=list(args), kwargs=kwargs or None, print_profile=False,
                             warm_up=0, as_string=False)


class Fn(nn.Module):
    """Wraps a plain function as a module, so the profiler sees a module frame around it.
    Pass a lambda that looks the torch function up at call time (the profiler replaces it)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def patched_state():
    """Every function the profiler replaces, as currently installed (identity snapshot)."""
    return {(id(owner), name): owner.__dict__.get(name) for owner, name, _ in _targets()}


# ----------------------------------------------------------------------------- dense layers
@pytest.mark.parametrize("bias", [True, False])
def test_linear_counts_two_flops_per_mac_and_no_bias_flops(bias):
    batch, seq, fin, fout = 3, 5, 7, 11
    flops, macs, params = profile(nn.Linear(fin, fout, bias=bias), torch.randn(batch, seq, fin))
    assert macs == batch * seq * fin * fout
    assert flops == 2 * macs
    assert params == fin * fout + (fout if bias else 0)


def conv_out(size, kernel, stride, padding, dilation=1):
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@pytest.mark.parametrize("stride,padding,groups,bias", [
    (1, 0, 1, True), (2, 1, 1, False), (1, 2, 2, True), (3, 1, 4, True), (2, 0, 8, False),
])
def test_conv2d_stride_padding_groups(stride, padding, groups, bias):
    batch, cin, cout, k, h, w = 2, 8, 16, 3, 13, 10
    conv = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, groups=groups, bias=bias)
    x = torch.randn(batch, cin, h, w)
    ho, wo = conv_out(h, k, stride, padding), conv_out(w, k, stride, padding)
    assert conv(x).shape == (batch, cout, ho, wo)  # the reference formula matches torch
    flops, macs, params = profile(conv, x)
    outputs = batch * cout * ho * wo
    assert macs == outputs * (cin // groups) * k * k
    assert flops == 2 * macs + (outputs if bias else 0)
    assert params == cout * (cin // groups) * k * k + (cout if bias else 0)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 2), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 5),
       st.integers(1, 2), st.integers(0, 2), st.integers(1, 2), st.integers(6, 12))
def test_conv1d_matches_formula_for_any_geometry(batch, groups, cin_per_group, k, stride, padding, dilation, length):
    cin, cout = cin_per_group * groups, 2 * groups
    conv = nn.Conv1d(cin, cout, k, stride=stride, padding=padding, dilation=dilation, groups=groups)
    lo = conv_out(length, k, stride, padding, dilation)
    if lo < 1:
        return
    flops, macs, _ = profile(conv, torch.randn(batch, cin, length))
    assert macs == batch * cout * lo * cin_per_group * k
    assert flops == 2 * macs + batch * cout * lo


def test_conv3d_and_transposed_conv():
    x = torch.randn(2, 4, 5, 6, 7)
    _, macs, _ = profile(nn.Conv3d(4, 6, (1, 2, 3), bias=False), x)
    assert macs == 2 * 6 * (5 * 5 * 5) * 4 * (1 * 2 * 3)

    # transposed: every input element is spread over out_channels/groups x kernel outputs
    batch, cin, cout, k, stride, h, w, groups = 2, 4, 6, 3, 2, 5, 4, 2
    deconv = nn.ConvTranspose2d(cin, cout, k, stride=stride, groups=groups)
    x = torch.randn(batch, cin, h, w)
    out = deconv(x)
    flops, macs, _ = profile(deconv, x)
    assert macs == batch * cin * h * w * (cout // groups) * k * k
    assert flops == 2 * macs + out.numel()


# ----------------------------------------------------------------------------- functional algebra
def test_matmul_family_inside_a_custom_forward():
    class Algebra(nn.Module):
        def forward(self, a, b, c, d):
            x = a @ b                      # (4, 3, 5) @ (5, 6): broadcast matmul
            y = torch.bmm(x, c)            # (4, 3, 6) @ (4, 6, 2)
            z = torch.matmul(d, y)         # (3,) @ (4, 3, 2) -> (4, 2)
            w = z.matmul(torch.ones(2))    # (4, 2) @ (2,) -> (4,)
            v = torch.mm(a[0], b)          # (3, 5) @ (5, 6)
            return w.sum() + v.sum()

    a, b, c, d = torch.randn(4, 3, 5), torch.randn(5, 6), torch.randn(4, 6, 2), torch.randn(3)
    flops, macs, params = profile(Algebra(), a, b, c, d)
    expected = 4 * 3 * 6 * 5 + 4 * 3 * 2 * 6 + 4 * 2 * 3 + 4 * 2 + 3 * 6 * 5
    assert macs == expected
    assert flops == 2 * expected
    assert params == 0


def test_addmm_and_baddbmm_add_one_flop_per_output():
    bias2, m1, m2 = torch.randn(6), torch.randn(3, 5), torch.randn(5, 6)
    flops, macs, _ = profile(Fn(lambda i, x, y: torch.addmm(i, x, y)), bias2, m1, m2)
    assert (flops, macs) == (2 * 3 * 5 * 6 + 3 * 6, 3 * 5 * 6)

    bias3, b1, b2 = torch.randn(4, 3, 6), torch.randn(4, 3, 5), torch.randn(4, 5, 6)
    flops, macs, _ = profile(Fn(lambda i, x, y: i.baddbmm(x, y)), bias3, b1, b2)
    assert (flops, macs) == (2 * 4 * 3 * 5 * 6 + 4 * 3 * 6, 4 * 3 * 5 * 6)


def test_attention_written_functionally():
    b, h, l, s, e = 2, 3, 5, 7, 4

    class Attention(nn.Module):
        def forward(self, q, k, v):
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(e)
            return F.softmax(scores, dim=-1) @ v

    q, k, v = torch.randn(b, h, l, e), torch.randn(b, h, s, e), torch.randn(b, h, s, e)
    flops, macs, _ = profile(Attention(), q, k, v)
    qk = b * h * l * s * e
    av = b * h * l * s * e
    assert macs == qk + av
    assert flops == 2 * (qk + av) + b * h * l * s  # + one FLOP per softmax element


def test_scaled_dot_product_attention():
    b, h, l, s, e, ev = 2, 2, 6, 8, 4, 5
    q, k, v = torch.randn(b, h, l, e), torch.randn(b, h, s, e), torch.randn(b, h, s, ev)
    flops, macs, _ = profile(Fn(lambda *qkv: F.scaled_dot_product_attention(*qkv)), q, k, v)
    assert macs == b * h * l * s * e + b * h * l * s * ev
    assert flops == 2 * macs


@pytest.mark.parametrize("equation,shapes,macs", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], 2 * 3 * 4 * 5),
    ("bhld,bhsd->bhls", [(2, 3, 4, 8), (2, 3, 6, 8)], 2 * 3 * 4 * 6 * 8),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 5)], 2 * 3 * 4 * 5),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)], 2 * 3 * 4 + 2 * 4 * 5),
])
def test_einsum_contractions(equation, shapes, macs):
    operands = [torch.randn(*s) for s in shapes]
    flops, counted_macs, _ = profile(Fn(lambda *ops: torch.einsum(equation, *ops)), *operands)
    assert counted_macs == macs
    assert flops == 2 * macs


def test_elementwise_add_and_mul_count_broadcast_output():
    x, y = torch.randn(4, 1, 5), torch.randn(3, 1)
    flops, macs, _ = profile(Fn(lambda a, b: torch.mul(torch.add(a, b), b)), x, y)
    assert (flops, macs) == (2 * 4 * 3 * 5, 0)


# ----------------------------------------------------------------------------- norms, activations, etc.
@pytest.mark.parametrize("module,per_element", [
    (nn.LayerNorm(6), 5), (nn.LayerNorm(6, elementwise_affine=False), 4),
    (nn.GroupNorm(2, 4), 5), (nn.InstanceNorm1d(4), 4),
])
def test_normalisations(module, per_element):
    x = torch.randn(3, 4, 6)
    flops, macs, _ = profile(module, x)
    assert (flops, macs) == (per_element * x.numel(), 0)


def test_batch_norm_training_and_inference():
    bn, x = nn.BatchNorm1d(4), torch.randn(5, 4)
    assert profile(bn.train(), x)[:2] == (5 * x.numel(), 0)
    assert profile(bn.eval(), x)[:2] == (2 * x.numel(), 0)


@pytest.mark.parametrize("module", [nn.ReLU(), nn.GELU(), nn.SiLU(), nn.Tanh(), nn.Sigmoid(), nn.LeakyReLU(),
                                    nn.ELU(), nn.ReLU6(), nn.Softmax(dim=-1), Fn(lambda x: F.tanh(x)), Fn(lambda x: torch.relu(x)),
                                    Fn(lambda x: x.sigmoid())])
def test_activations_count_one_flop_per_element_once(module):
    x = torch.randn(3, 7)
    assert profile(module, x)[:2] == (x.numel(), 0)


@pytest.mark.parametrize("module", [nn.MaxPool2d(2), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1)])
def test_pooling_counts_input_elements(module):
    x = torch.randn(2, 3, 6, 6)
    assert profile(module, x)[:2] == (x.numel(), 0)


def test_embedding_costs_nothing_but_has_parameters():
    flops, macs, params = profile(nn.Embedding(50, 8), torch.randint(0, 50, (4, 6)))
    assert (flops, macs, params) == (0, 0, 50 * 8)


def test_mlp_total():
    batch, din, hidden, dout = 4, 10, 32, 3
    mlp = nn.Sequential(nn.Linear(din, hidden), nn.GELU(), nn.Linear(hidden, dout))
    flops, macs, params = profile(mlp, torch.randn(batch, din))
    assert macs == batch * (din * hidden + hidden * dout)
    assert flops == 2 * macs + batch * hidden
    assert params == sum(p.numel() for p in mlp.parameters())


def test_multihead_attention_module_is_counted_through_its_functionals():
    b, l, d, heads = 2, 5, 8, 2
    mha = nn.MultiheadAttention(d, heads, batch_first=True).train()
    x = torch.randn(b, l, d)
    _, macs, _ = profile(mha, x, x, x)
    projections = 4 * b * l * d * d                     # q, k, v and output projections
    attention = 2 * b * heads * l * l * (d // heads)    # Q K^T and A V
    assert macs == projections + attention


# ----------------------------------------------------------------------------- params and attribution
def test_params_count_trainable_parameters_once():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 2))
    model[3].weight.requires_grad_(False)
    flops, macs, params = profile(model, torch.randn(1, 4))
    assert params == (16 + 4) + 2  # shared once; the frozen weight is not counted
    assert macs == 16 + 16 + 8     # but the shared layer ran twice


def test_per_module_attribution_and_ignore_list():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x) @ torch.ones(4, 2)  # own work: 1 x 4 x 2 MACs

    model = nn.Sequential(Block(), nn.Linear(2, 3))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(1, 4))
    prof.stop_profile()
    assert get_module_macs(model[0].inner) == 16
    assert get_module_macs(model[0]) == 16 + 8
    assert prof.get_total_macs() == 16 + 8 + 6
    # latency is inclusive: a parent spans its children
    assert prof.get_total_duration() >= model[0].__dict__["_dsplug_flops_profile"].duration > 0
    prof.end_profile()

    # ignoring Block drops everything computed inside it, its children included
    _, macs, _ = get_model_profile(model, args=[torch.randn(1, 4)], print_profile=False, warm_up=0,
                                   as_string=False, ignore_modules=[Block])
    assert macs == 6


def test_profiler_lifecycle():
    model = nn.Linear(3, 2)
    prof = FlopsProfiler(model)
    with pytest.raises(RuntimeError, match="nothing has been profiled"):
        prof.print_model_profile()
    prof.start_profile()
    model(torch.randn(5, 3))
    assert prof.get_total_macs() == 5 * 3 * 2
    prof.reset_profile()
    assert prof.get_total_macs() == 0
    model(torch.randn(1, 3))
    prof.stop_profile()
    model(torch.randn(7, 3))  # after stop: not counted
    assert prof.get_total_macs() == 3 * 2
    assert prof.get_total_flops(as_string=True) == number_to_string(12)
    assert prof.get_total_params(as_string=True) == "8"
    prof.end_profile()
    assert "_dsplug_flops_profile" not in model.__dict__
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert get_module_flops(model) == 0


def test_only_one_profile_counts_at_a_time():
    a, b = FlopsProfiler(nn.Linear(2, 2)), FlopsProfiler(nn.Linear(2, 2))
    a.start_profile()
    try:
        with pytest.raises(RuntimeError, match="already counting"):
            b.start_profile()
    finally:
        a.end_profile()
    b.start_profile()
    b.end_profile()


def test_functions_are_restored_after_the_model_raises():
    before = patched_state()
    originals = (F.linear, torch.matmul, torch.Tensor.__dict__.get("__matmul__"))

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            self.fc(x)
            raise ValueError("boom")

    model = Broken()
    with pytest.raises(ValueError, match="boom"):
        get_model_profile(model, input_shape=(1, 2), warm_up=0)
    assert patched_state() == before
    assert (F.linear, torch.matmul, torch.Tensor.__dict__.get("__matmul__")) == originals
    assert "__matmul__" not in torch.Tensor.__dict__
    assert not model.fc._forward_hooks and "_dsplug_flops_profile" not in model.fc.__dict__
    # and a fresh profile works afterwards
    assert profile(nn.Linear(2, 2), torch.randn(1, 2))[1] == 4


def test_warm_up_generate_mode_and_kwargs():
    class Generator(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.calls = 0

        def forward(self, x, scale=1.0):
            self.calls += 1
            return self.fc(x) * scale

        def generate(self, x, steps=2):
            for _ in range(steps):
                x = self(x)
            return x

    model = Generator()
    _, macs, _ = get_model_profile(model, args=[torch.randn(1, 3)], kwargs={"steps": 3}, mode="generate",
                                   print_profile=False, warm_up=2, as_string=False)
    assert macs == 3 * 9
    assert model.calls == 3 * 3  # two warm-ups and the profiled call
    _, macs, _ = get_model_profile(model, args=[torch.randn(2, 3)], kwargs={"scale": 2.0},
                                   print_profile=False, warm_up=0, as_string=False)
    assert macs == 2 * 9


@pytest.mark.parametrize("kwargs,message", [
    ({"input_shape": (2, 3), "args": [torch.ones(1)]}, "either input_shape"),
    ({"input_shape": (0, 3)}, "positive integers"),
    ({}, "nothing to call the model with"),
    ({"input_shape": (1, 3), "mode": "backward"}, "mode must be one of"),
    ({"input_shape": (1, 3), "mode": "generate"}, "generate\\(\\) method"),
    ({"input_shape": (1, 3), "module_depth": -2}, "module_depth must be an integer >= -1"),
    ({"input_shape": (1, 3), "top_modules": 0}, "top_modules must be an integer >= 1"),
    ({"input_shape": (1, 3), "ignore_modules": ["Linear"]}, "torch.nn.Module classes"),
])
def test_get_model_profile_argument_errors(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        get_model_profile(nn.Linear(3, 3), **kwargs)


# ----------------------------------------------------------------------------- strings and output
def test_number_formatting():
    assert number_to_string(1234567) == "1.23 M"
    assert number_to_string(0) == "0 "
    assert number_to_string(2.5e12) == "2.5 T"
    assert number_to_string(999) == "999 "
    assert number_to_string(1234567, units="K") == number_to_string(1234567, units="k") == "1234.57 K"
    assert macs_to_string(3.14e9) == "3.14 GMACs"
    assert flops_to_string(8.2e13) == "82 TFLOPS"
    assert params_to_string(1.5e9) == "1.5 B"
    assert params_to_string(336.23e6) == "336.23 M"
    assert params_to_string(2) == "2"
    assert duration_to_string(0.07639) == "76.39 ms"
    assert duration_to_string(34.09e-6) == "34.09 us"
    with pytest.raises(ValueError, match="unknown units 'X'"):
        number_to_string(1, units="X")


def test_as_string_on_and_off():
    model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10))
    x = torch.randn(8, 100)
    numbers = get_model_profile(model, args=[x], print_profile=False, warm_up=0, as_string=False)
    strings = get_model_profile(model, args=[x], print_profile=False, warm_up=0, as_string=True)
    assert all(isinstance(n, int) for n in numbers)
    macs = 8 * (100 * 300 + 300 * 10)
    assert numbers == (2 * macs + 8 * 300, macs, 100 * 300 + 300 + 300 * 10 + 10)
    assert strings == (number_to_string(numbers[0]), macs_to_string(numbers[1]), params_to_string(numbers[2]))
    assert strings == ("530.4 K", "264 KMACs", "33.31 K")  # DeepSpeed's unit letter for thousands


class Deep(nn.Module):
    """depth 0 Deep -> 1 Sequential/Linear -> 2 Linear/Sequential -> 3 ReLU"""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU()), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(self.head(x))


def aggregated_depths(text):
    """{depth: {"params": {...}, "MACs": {...}, "fwd latency": {...}}} parsed from the printout."""
    section = text.split("Aggregated Profile per GPU")[1].split("Detailed Profile per GPU")[0]
    depths, current = {}, None
    for line in section.splitlines():
        head = re.match(r"depth (\d+):", line)
        if head:
            current = depths.setdefault(int(head.group(1)), {})
        elif current is not None and " - " in line:
            key, value = line.split(" - ", 1)
            current[key.strip()] = ast.literal_eval(value)
    return depths


def test_module_depth_and_top_modules_in_the_printout(capsys):
    x = torch.randn(2, 4)
    get_model_profile(Deep(), args=[x], warm_up=0, detailed=False)
    text = capsys.readouterr().out
    assert "Profile Summary at step 0:" in text and "Detailed Profile" not in text
    depths = aggregated_depths(text)
    assert sorted(depths) == [0, 1, 2, 3]
    assert depths[1]["params"] == {"Sequential": params_to_string(8 * 8 + 8 + 8 * 2 + 2)}
    assert depths[2]["MACs"] == {"Linear": macs_to_string(2 * (8 * 8 + 8 * 2))}  # two Linears summed

    get_model_profile(Deep(), args=[x], warm_up=0, detailed=False, module_depth=1, top_modules=2)
    depths = aggregated_depths(capsys.readouterr().out)
    assert sorted(depths) == [0, 1]
    assert list(depths[1]["params"]) == ["Sequential", "Linear"]  # sorted, largest first
    assert depths[1]["MACs"] == {"Sequential": macs_to_string(2 * 80), "Linear": macs_to_string(2 * 32)}


def test_detailed_tree_lists_every_module_with_percentages(capsys):
    get_model_profile(Deep(), input_shape=(2, 4), warm_up=1)
    text = capsys.readouterr().out
    tree = text.split("Detailed Profile per GPU")[1]
    total_macs = 2 * (32 + 64 + 16)
    assert re.search(r"^Deep\(\n  130, 100\.00% Params, 224 MACs, 100\.00% MACs, ", tree, re.M)
    head = re.search(r"\(head\): Linear\(40, ([\d.]+)% Params, 64 MACs, ([\d.]+)% MACs, .*in_features=4", tree)
    assert head and float(head.group(1)) == round(100 * 40 / 130, 2)
    assert float(head.group(2)) == round(100 * 64 / total_macs, 2)
    assert re.search(r"^      \(0\): ReLU\(0, 0\.00% Params, 0 MACs", tree, re.M)  # nested 3 levels deep
    assert "fwd MACs per GPU:" in text and macs_to_string(total_macs) in text


def test_output_file_gets_the_profile_instead_of_stdout(tmp_path, capsys):
    target = tmp_path / "reports" / "flops.txt"
    get_model_profile(Deep(), input_shape=(2, 4), warm_up=0, output_file=str(target))
    assert capsys.readouterr().out == ""
    written = target.read_text()
    assert written.startswith("-" * 26 + " DeepSpeed Flops Profiler")
    assert "(body): Sequential(" in written and "Aggregated Profile per GPU" in written


def test_recurrent_layers_are_reported_as_not_counted(capsys):
    model = nn.LSTM(4, 3, batch_first=True)
    get_model_profile(model, input_shape=(2, 5, 4), warm_up=0, detailed=False)
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("not counted")]
    assert line == ["not counted (fused kernels, reported as 0 MACs): LSTM"]


def test_functions_called_with_out_argument_are_counted():
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.empty(3, 5)
    flops, macs, _ = profile(Fn(lambda x, y, z: torch.mm(x, y, out=z)), a, b, c)
    assert (flops, macs) == (2 * 3 * 4 * 5, 3 * 4 * 5)


def test_an_uncountable_call_warns_once_and_the_forward_still_runs():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    model = Fn(lambda x, y: torch.einsum(x, [0, 1], y, [1, 2], [0, 2]))  # sublist form: not counted
    with pytest.warns(RuntimeWarning, match=r"torch\.einsum was not counted .*sublist"):
        flops, macs, _ = profile(model, a, b)
    assert (flops, macs) == (0, 0)
    torch.testing.assert_close(model(a, b), a @ b)


def test_deepspeed_import_paths():
    import dsplug
    from dsplug.profiling.flops_profiler.profiler import FlopsProfiler as FromProfilerModule

    assert dsplug.profiling.flops_profiler.get_model_profile is get_model_profile
    assert FromProfilerModule is FlopsProfiler
