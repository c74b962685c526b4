"""The seven ``compression_training`` examples of DeepSpeed's config documentation, end to end.

tests/data/compression/*.json hold the documented example blocks (reconstructed from the
reference scrape, which lost closing brackets; the sparse-pruning example writes
``'excluded_modules': ['classifier', 'pooler']`` with single quotes, which is not JSON -- the file
uses double quotes). Each one must pass ``dsplug config check``, train through
``dsplug.initialize`` on a tiny model whose module names its patterns match, and visibly do what
it documents; the structured-pruning ones must also come out of ``redundancy_clean`` smaller and
computing the same function. All schedule offsets are the documented ones (no overrides).

What a method did is observed from the outside wherever possible: the tensors a layer actually
hands to ``F.linear`` (recorded with a TorchFunctionMode while that layer runs), the outputs of
convolutions (forward hooks), shapes after cleaning -- checked against expectations computed here
(quantization grids, the cubic sparsity schedule, kept counts).
"""
from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip("transformers")

import dsplug  # noqa: E402
from dsplug.cli import main as cli_main  # noqa: E402
from dsplug.compression.compress import init_compression, redundancy_clean  # noqa: E402
from tests.conftest import REPO, scaled

DATA = REPO / "tests" / "data" / "compression"
EXAMPLES = ("layer_reduction", "weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning",
            "head_pruning", "channel_pruning")
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
SEQ = 8


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast, and immune to a busy second core (two spinning
    OpenMP threads on one free core made this file 15x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def example(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def config_for(name: str, **extra) -> dict:
    config = copy.deepcopy(BASE)
    config.update(example(name))
    if name == "weight_quantization":  # quantize_weight_in_forward false needs 16-bit weights
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


# ---------------------------------------------------------------------------------------------- models
def tiny_bert(layers: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=24, num_hidden_layers=layers, num_attention_heads=12,
                                  intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def bert_batch(step: int, size: int = 2):
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, 50, (size, SEQ), generator=g), torch.randint(0, 2, (size,), generator=g)


class Block(nn.Module):
    """A ResNet basic block: conv1 -> bn1 -> relu -> conv2 -> bn2, plus the residual."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return self.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layer1 = nn.Sequential(Block(channels), Block(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(self.layer1(self.stem(x)).mean(dim=(2, 3)))


def image_batch(step: int, size: int = 2):
    g = torch.Generator().manual_seed(20_000 + step)
    return torch.randn(size, 3, 6, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def train_bert(engine, steps: int, start: int = 0):
    losses = []
    for step in range(start, start + steps):
        ids, labels = bert_batch(step)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    assert all(math.isfinite(x) for x in losses), losses
    return losses


def bert_logits(model, step: int = 999):
    ids, _ = bert_batch(step, size=3)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ---------------------------------------------------------------------------------------------- observing layers
class LinearCalls(TorchFunctionMode):
    """Records, per module name, the (input, weight, bias) that the module's forward passes to
    ``F.linear`` -- what the layer really computes with, after any masking / quantization."""

    def __init__(self, model: nn.Module, names):
        super().__init__()
        self.calls = {}
        self._current = []
        self._handles = []
        modules = dict(model.named_modules())
        for name in names:
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(module, args):
            self._current.append(name)
        return hook

    def _leave(self, module, args, output):
        self._current.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self._current:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            self.calls.setdefault(self._current[-1], []).append(
                (x.detach().clone(), w.detach().clone(), None if b is None else b.detach().clone()))
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)


def linear_names(model: nn.Module):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def record_linear(model: nn.Module, names, run):
    with LinearCalls(model, names) as rec:
        run()
    for name in names:
        count = len(rec.calls.get(name, ()))
        assert count == 1, f"{name}: expected one F.linear call, got {count}"
    return {name: rec.calls[name][0] for name in names}


# ---------------------------------------------------------------------------------------------- 1. config check
def check_cli(capsys, path) -> tuple:
    """``dsplug config check PATH`` through the CLI's entry function (as tests/core/test_cli.py does)."""
    code = cli_main(["config", "check", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_config(tmp_path, name: str, config: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def fp32_weight_quantization() -> dict:
    config = config_for("weight_quantization")
    del config["bf16"]
    return config


def test_example_files_hold_exactly_the_documented_blocks():
    ex = {name: example(name) for name in EXAMPLES}
    for name, body in ex.items():
        assert list(body) == ["compression_training"] and list(body["compression_training"]) == [name]
    lr = ex["layer_reduction"]["compression_training"]["layer_reduction"]
    assert lr == {"enabled": True, "keep_number_layer": 5, "module_name_prefix": "bert.encoder.layer",
                  "teacher_layer": [2, 4, 6, 8, 10], "other_module_name": ["bert.pooler", "bert.embeddings",
                                                                           "classifier"]}
    wq = ex["weight_quantization"]["compression_training"]["weight_quantization"]
    assert wq["shared_parameters"]["fp16_mixed_quantize"] == {"enabled": False, "quantize_change_ratio": 0.001}
    assert wq["different_groups"]["wq2"] == {"params": {"start_bits": 4, "target_bits": 4, "quantization_period": 50},
                                             "modules": ["attention.output"]}
    sp = ex["sparse_pruning"]["compression_training"]["sparse_pruning"]
    # the documentation writes ['classifier', 'pooler'] (single quotes, not JSON): double quotes here
    assert sp["shared_parameters"]["excluded_modules"] == ["classifier", "pooler"] and sp["different_groups"] == {}
    rp = ex["row_pruning"]["compression_training"]["row_pruning"]["different_groups"]["rp1"]
    assert rp["related_modules"] == [["layer.\\w+.output.dense"]]  # the regex layer.\w+.output.dense
    ch = ex["channel_pruning"]["compression_training"]["channel_pruning"]["different_groups"]["cp1"]
    assert ch["modules"] == ["layer....conv1"] and ch["related_modules"] == [["layer....conv2", "layer....bn1"]]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_passes_config_check(tmp_path, capsys, name):
    path = write_config(tmp_path, name, config_for(name))
    code, out, err = check_cli(capsys, path)
    assert code == 0, err
    assert out.strip() == f"{path}: valid", out


def test_example_passes_config_check_in_a_cli_process(tmp_path):
    """The real ``python -m dsplug.cli`` process, once (each process pays the import of torch)."""
    path = write_config(tmp_path, "sparse_pruning", config_for("sparse_pruning"))
    done = subprocess.run([sys.executable, "-m", "dsplug.cli", "config", "check", str(path)], capture_output=True,
                          text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{path}: valid"


def test_config_check_would_catch_a_broken_example(tmp_path, capsys):
    config = config_for("head_pruning")
    del config["compression_training"]["head_pruning"]["shared_parameters"]["num_heads"]
    code, _, err = check_cli(capsys, write_config(tmp_path, "broken", config))
    assert code == 1 and "num_heads" in err, err


def test_weight_quantization_example_in_fp32_is_rejected_by_initialize():
    with pytest.raises(ValueError, match="quantize_weight_in_forward"):
        dsplug.initialize(model=tiny_bert(), config=fp32_weight_quantization())


def test_weight_quantization_example_in_fp32_is_rejected_by_config_check(tmp_path, capsys):
    code, out, err = check_cli(capsys, write_config(tmp_path, "wq_fp32", fp32_weight_quantization()))
    assert code == 1, out
    assert "quantize_weight_in_forward" in err


# ---------------------------------------------------------------------------------------------- 2. training
def test_layer_reduction_student_from_teacher_layers():
    config = config_for("layer_reduction")
    teacher = tiny_bert(layers=12, seed=1)
    student = init_compression(tiny_bert(layers=12, seed=2), config, teacher_model=teacher)
    layers = student.bert.encoder.layer
    assert len(layers) == 5 and student.config.num_hidden_layers == 5
    teacher_state = teacher.state_dict()
    for i, t in enumerate([2, 4, 6, 8, 10]):
        for key, value in layers[i].state_dict().items():
            assert torch.equal(value, teacher_state[f"bert.encoder.layer.{t}.{key}"]), (i, key)
    for module in ("bert.pooler", "bert.embeddings", "classifier"):
        for key, value in student.get_submodule(module).state_dict().items():
            assert torch.equal(value, teacher_state[f"{module}.{key}"]), (module, key)
    assert len(student.state_dict()) < len(teacher_state)


def test_layer_reduction_student_trains_through_initialize():
    """DeepSpeed's workflow: init_compression(student, config, teacher_model=teacher), then initialize
    with the same config -- the engine keeps the 5-layer student as it is and trains it."""
    config = config_for("layer_reduction")
    student = init_compression(tiny_bert(layers=12, seed=2), config, teacher_model=tiny_bert(layers=12, seed=1))
    before = copy.deepcopy(student.state_dict())
    engine, _, _, _ = dsplug.initialize(model=student, config=config)
    assert len(engine.module.bert.encoder.layer) == 5
    assert all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    train_bert(engine, 3)
    assert not torch.equal(engine.module.bert.encoder.layer[0].intermediate.dense.weight, before[
        "bert.encoder.layer.0.intermediate.dense.weight"])


def test_layer_reduction_by_the_engine_alone_keeps_the_models_own_layers():
    model = tiny_bert(layers=12, seed=3)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _, _, _ = dsplug.initialize(model=model, config=config_for("layer_reduction"))
    layers = engine.module.bert.encoder.layer
    assert len(layers) == 5
    for i, t in enumerate([2, 4, 6, 8, 10]):
        for key, value in layers[i].state_dict().items():
            assert torch.equal(value, original[f"bert.encoder.layer.{t}.{key}"]), (i, key)
    train_bert(engine, 2)


def _wq_bits(name: str):
    """The documented groups: wq1 (8 bits) = attention.self + intermediate, wq2 (4 bits) = attention.output."""
    if re.search(r"attention\.self\.(query|key|value)$", name) or name.endswith("intermediate.dense"):
        return 8
    if name.endswith("attention.output.dense"):
        return 4
    return None


def test_weight_quantization_puts_selected_weights_on_their_grid():
    engine, _, _, _ = dsplug.initialize(model=tiny_bert(), config=config_for("weight_quantization"))
    train_bert(engine, 2)
    model = engine.module
    seen = {8: 0, 4: 0, None: 0}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        bits = _wq_bits(name)
        seen[bits] += 1
        w = module.weight.detach()
        assert w.dtype == torch.bfloat16
        w = w.float()
        distinct = torch.unique(w).numel()
        if bits is None:
            if w.numel() >= 1000:  # an unselected layer keeps far more values than an 8-bit grid has
                assert distinct > 2 ** 8, (name, distinct)
            continue
        qmax = 2 ** (bits - 1) - 1  # symmetric: the levels -qmax .. qmax
        assert distinct <= 2 * qmax + 1, (name, bits, distinct)
        ratio = w / (w.abs().max() / qmax)
        # bf16 keeps 8 significant bits: level q is stored within |q| * 2**-8 of itself
        assert bool(((ratio - ratio.round()).abs() <= ratio.round().abs() * 2 ** -8 + 1e-3).all()), name
    assert seen == {8: 8, 4: 2, None: 4}, seen  # 2 layers x (q, k, v, intermediate) / (attention out); rest


def _dynamic_asym_reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).float()
    lo, hi = rows.min(1, keepdim=True).values, rows.max(1, keepdim=True).values
    levels = 2 ** bits - 1
    scale = (hi - lo) / levels
    q = torch.clamp(torch.round((rows - lo) / scale), 0, levels)
    return (q * scale + lo).reshape(x.shape)


def test_activation_quantization_from_step_50():
    engine, _, _, _ = dsplug.initialize(model=tiny_bert(), config=config_for("activation_quantization"))
    model = engine.module
    selected = [n for n in linear_names(model) if n.endswith("attention.output.dense")]
    others = [n for n in linear_names(model) if n.endswith("intermediate.dense")]
    assert len(selected) == 2

    def observe():
        calls = record_linear(model, selected + others, lambda: bert_logits(model, step=0))
        model.train()
        return calls

    train_bert(engine, 49)  # documented schedule_offset 50: still full precision after 49 steps
    calls = observe()
    for name in selected:
        x = calls[name][0].reshape(-1, 24)
        assert max(torch.unique(row).numel() for row in x) > 20  # raw activations
        assert not torch.allclose(x, _dynamic_asym_reference(x, 8).reshape(x.shape), atol=1e-7)

    train_bert(engine, 1, start=49)  # step 50: on
    calls = observe()
    for name in selected:
        x = calls[name][0]
        rows = x.reshape(-1, x.shape[-1])
        lo, hi = rows.min(1, keepdim=True).values, rows.max(1, keepdim=True).values
        steps = (rows - lo) / ((hi - lo) / 255)
        assert (steps - steps.round()).abs().max() < 1e-3, name  # per token: on an 8-bit asymmetric grid
        assert all(torch.unique(row).numel() <= 2 ** 8 for row in rows)
    for name in others:  # not in the group: untouched
        rows = calls[name][0].reshape(-1, 24)
        steps = (rows - rows.min(1, keepdim=True).values) / ((rows.max(1, keepdim=True).values
                                                                - rows.min(1, keepdim=True).values) / 255)
        assert (steps - steps.round()).abs().max() > 0.05, name
    train_bert(engine, 2, start=50)


def test_activation_quantization_matches_the_reference_quantizer():
    """The selected layer computes linear(Q(x)) with Q = per-token 8-bit asymmetric rounding."""
    engine, _, _, _ = dsplug.initialize(model=tiny_bert(), config=config_for("activation_quantization"))
    model = engine.module
    train_bert(engine, 50)
    name = "bert.encoder.layer.1.attention.output.dense"
    layer = model.get_submodule(name)
    seen = {}
    handle = layer.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), y=o.detach()))
    bert_logits(model, step=1)
    handle.remove()
    expected = F.linear(_dynamic_asym_reference(seen["x"], 8), layer.weight.detach(), layer.bias.detach())
    torch.testing.assert_close(seen["y"], expected, atol=1e-5, rtol=0)
    plain = F.linear(seen["x"], layer.weight.detach(), layer.bias.detach())
    assert (seen["y"] - plain).abs().max() > 1e-5


def _sparse_targets(model):
    return [n for n in linear_names(model) if "classifier" not in n and "pooler" not in n]


def _cubic(step, start=30, end=90, stride=15, final=0.6):
    t = start + (step - start) // stride * stride
    return final * (1 - (1 - (t - start) / (end - start)) ** 3)


def test_sparse_pruning_snip_momentum_schedule():
    engine, _, _, _ = dsplug.initialize(model=tiny_bert(), config=config_for("sparse_pruning"))
    model = engine.module
    names = linear_names(model)
    targets = _sparse_targets(model)
    assert len(targets) == 12

    def effective_weights():
        calls = record_linear(model, names, lambda: bert_logits(model, step=0))
        model.train()
        return {n: calls[n][1] for n in names}

    total_blocks = sum(model.get_submodule(n).weight.numel() // 4 for n in targets)
    observed = {}
    done = 0
    for stop in (29, 45, 95):  # before the offset; a stride plateau; past schedule_offset_end
        train_bert(engine, stop - done, start=done)
        done = stop
        weights = effective_weights()
        for n in names:
            if n not in targets:
                assert int((weights[n] == 0).sum()) == 0, n  # excluded_modules
        zero_blocks = 0
        for n in targets:
            zero = (weights[n] == 0)
            blocks = zero.reshape(zero.shape[0] // 4, 4, zero.shape[1])  # 4x1: 4 rows x 1 column
            assert torch.equal(blocks.all(1), blocks.any(1)), n  # whole blocks only
            zero_blocks += int(blocks.all(1).sum())
        observed[stop] = zero_blocks
    assert observed[29] == 0
    assert observed[45] == round(_cubic(45) * total_blocks) > 0
    assert observed[95] == round(0.6 * total_blocks)
    # after schedule_offset_end the mask stays: the pruned weights stay out of the computation
    cleaned = redundancy_clean(model, config_for("sparse_pruning"))
    zeros = sum(int((cleaned.get_submodule(n).weight == 0).sum()) for n in targets)
    assert zeros == 4 * round(0.6 * total_blocks)
    assert all(type(cleaned.get_submodule(n)) is nn.Linear for n in names)


# ---------------------------------------------------------------------------------------------- 3. structured pruning
def test_row_pruning_then_redundancy_clean():
    config = config_for("row_pruning")
    engine, _, _, _ = dsplug.initialize(model=tiny_bert(), config=config)
    model = engine.module
    rows = [f"bert.encoder.layer.{i}.intermediate.dense" for i in range(2)]
    train_bert(engine, 19)
    calls = record_linear(model, rows, lambda: bert_logits(model))
    assert all(int((calls[n][1] == 0).all(1).sum()) == 0 for n in rows)  # schedule_offset 20: not yet
    model.train()
    train_bert(engine, 3, start=19)
    calls = record_linear(model, rows, lambda: bert_logits(model))
    for n in rows:
        _, w, b = calls[n]
        pruned = (w == 0).all(1)
        assert int(pruned.sum()) == 24, n  # dense_ratio 0.5 of 48 rows
        assert bool((b[pruned] == 0).all()) and bool((b[~pruned] != 0).all())
    expected = bert_logits(model)
    cleaned = redundancy_clean(model, config)
    for i in range(2):
        inter = cleaned.get_submodule(f"bert.encoder.layer.{i}.intermediate.dense")
        out = cleaned.get_submodule(f"bert.encoder.layer.{i}.output.dense")
        assert type(inter) is nn.Linear and (inter.in_features, inter.out_features) == (24, 24)
        assert inter.bias.shape == (24,)
        assert (out.in_features, out.out_features) == (24, 24)
        attn_out = cleaned.get_submodule(f"bert.encoder.layer.{i}.attention.output.dense")
        assert (attn_out.in_features, attn_out.out_features) == (24, 24)  # not a related module
    torch.testing.assert_close(bert_logits(cleaned), expected, atol=1e-5, rtol=0)


def test_head_pruning_then_redundancy_clean():
    config = config_for("head_pruning")
    engine, _, _, _ = dsplug.initialize(model=tiny_bert(), config=config)
    model = engine.module
    outs = [f"bert.encoder.layer.{i}.attention.output.dense" for i in range(2)]
    train_bert(engine, 9)
    calls = record_linear(model, outs, lambda: bert_logits(model))
    assert all(int((calls[n][1] == 0).all(0).sum()) == 0 for n in outs)  # schedule_offset 10: not yet
    model.train()
    train_bert(engine, 3, start=9)
    calls = record_linear(model, outs, lambda: bert_logits(model))
    for n in outs:
        heads = calls[n][1].reshape(24, 12, 2)  # 12 heads of 2 input columns each
        assert int((heads == 0).all(2).all(0).sum()) == 6, n  # dense_ratio 0.5 of 12 heads
        assert int((calls[n][1] == 0).all(0).sum()) == 12
    expected = bert_logits(model)
    cleaned = redundancy_clean(model, config)
    for i in range(2):
        attention = cleaned.get_submodule(f"bert.encoder.layer.{i}.attention")
        for proj in ("query", "key", "value"):
            lin = getattr(attention.self, proj)
            assert type(lin) is nn.Linear and (lin.in_features, lin.out_features) == (24, 12)
        assert (attention.output.dense.in_features, attention.output.dense.out_features) == (12, 24)
        assert attention.self.num_attention_heads == 6 and attention.self.all_head_size == 12
    torch.testing.assert_close(bert_logits(cleaned), expected, atol=1e-5, rtol=0)


def _trained_resnet(config):
    torch.manual_seed(0)
    engine, _, _, _ = dsplug.initialize(model=TinyResNet(), config=config)
    for step in range(4):
        x, y = image_batch(step)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        assert math.isfinite(loss.item())
    return engine.module


def _resnet_eval(model, conv_names=()):
    outputs = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outputs.update({n: o.detach()}))
               for n in conv_names]
    x, _ = image_batch(999)
    model.eval()
    with torch.no_grad():
        logits = model(x)
    for h in handles:
        h.remove()
    return logits, outputs


def test_channel_pruning_masks_half_the_output_channels():
    model = _trained_resnet(config_for("channel_pruning"))
    convs = [f"layer1.{i}.conv1" for i in range(2)]
    _, outputs = _resnet_eval(model, convs + ["stem", "layer1.0.conv2"])
    for n in convs:  # schedule_offset 0: pruned from the first step
        assert int((outputs[n] == 0).all(3).all(2).all(0).sum()) == 4, n  # dense_ratio 0.5 of 8 channels
    for n in ("stem", "layer1.0.conv2"):  # not selected
        assert int((outputs[n] == 0).all(3).all(2).all(0).sum()) == 0, n


def test_channel_pruning_redundancy_clean():
    config = config_for("channel_pruning")
    model = _trained_resnet(config)
    expected, _ = _resnet_eval(model)
    cleaned = redundancy_clean(model, config)
    for i in range(2):
        block = cleaned.layer1[i]
        assert type(block.conv1) is nn.Conv2d and (block.conv1.in_channels, block.conv1.out_channels) == (8, 4)
        assert block.bn1.num_features == 4 and block.bn1.running_mean.shape == (4,)
        assert (block.conv2.in_channels, block.conv2.out_channels) == (4, 8)
        assert block.bn2.num_features == 8
    assert cleaned.stem.out_channels == 8
    # the same function: a pruned channel reaches conv2 as relu(bn1(0)) = relu(beta) = 0 (its running
    # mean stays 0 and beta gets no gradient through relu at 0), so removing it changes nothing
    got, _ = _resnet_eval(cleaned)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
