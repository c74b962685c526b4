"""Activation checkpointing: ``dsplug.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``) and
the ``activation_checkpointing`` config section.

Every gradient comparison is exact (``torch.equal``, fp32): the recompute must draw the same
dropout masks and run the same ops as the first forward.
"""
from __future__ import annotations

import collections
import json
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsplug
from dsplug.cli import main as cli_main
from dsplug.contracts import Monitor
from dsplug.plugins.activation_checkpointing import checkpointing as impl
from dsplug.plugins.train.model import CharTransformer, ModelConfig, next_token_loss
from dsplug.testing import ObserverContract

from tests.dist_harness import run_distributed

ck = dsplug.checkpointing

MODES = {
    "plain": {},
    "cpu": {"checkpoint_in_cpu": True},
    "partition": {"partition_activations": True},
    "partition+cpu+contiguous": {"partition_activations": True, "checkpoint_in_cpu": True,
                                 "contiguous_checkpointing": True, "num_checkpoints": 3},
    "synchronize+profile": {"synchronize": True, "profile": True},
}


def _fresh():
    impl._apply(impl.CheckpointingSettings(), None)
    impl._configured = False
    impl.collect_profile()
    impl.get_cuda_rng_tracker().reset()


@pytest.fixture(autouse=True)
def fresh_state():
    _fresh()
    yield
    _fresh()


# ------------------------------------------------------------------------------ models
class MlpBlock(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(width, 2 * width), nn.Dropout(0.3), nn.Linear(2 * width, width)

    def forward(self, x, scale=1.0):
        return x + self.fc2(self.drop(torch.relu(self.fc1(x)))) * scale


class TransformerBlock(nn.Module):
    """Pre-LN block with attention dropout (SDPA's dropout_p), residual dropout, and a
    model-parallel-style dropout drawn from the RNG tracker's stream."""

    def __init__(self, d=16, heads=2, tracker_dropout=False):
        super().__init__()
        self.heads, self.tracker_dropout = heads, tracker_dropout
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        h = self.mlp(self.ln2(x))
        if self.tracker_dropout:
            with ck.get_cuda_rng_tracker().fork():
                h = F.dropout(h, 0.25, training=True)
        return x + self.drop(h)


def _grads(model, x, use_checkpoint, extra=(), seed=123, checkpoint_fn=None):
    """Loss, parameter grads and input grad of ``model``'s blocks in sequence."""
    checkpoint_fn = checkpoint_fn or ck.checkpoint
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    h = x
    for block in model:
        h = checkpoint_fn(block, h, *extra) if use_checkpoint else block(h, *extra)
    loss = h.pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], x.grad.clone()


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
    assert torch.equal(a[2], b[2])


# ------------------------------------------------------------------------------ exact gradients
@pytest.mark.parametrize("mode", list(MODES))
def test_mlp_with_dropout_gradients_are_exact(mode):
    torch.manual_seed(0)
    model = nn.Sequential(*[MlpBlock() for _ in range(3)])
    x = torch.randn(4, 8)
    reference = _grads(model, x, False, extra=(0.5,))
    ck.configure(None, **MODES[mode])
    _assert_same(reference, _grads(model, x, True, extra=(0.5,)))
    if MODES[mode].get("profile"):
        rows = ck.collect_profile()
        assert rows["MlpBlock"]["calls"] == 3 and rows["MlpBlock"]["recompute_ms"] > 0


@pytest.mark.parametrize("mode", ["plain", "partition+cpu+contiguous"])
def test_transformer_block_with_dropout_and_tracker_dropout_is_exact(mode):
    torch.manual_seed(0)
    model = nn.Sequential(*[TransformerBlock(tracker_dropout=True) for _ in range(3)])
    x = torch.randn(2, 6, 16)
    ck.model_parallel_cuda_manual_seed(7)
    states = ck.get_cuda_rng_tracker().get_states()
    reference = _grads(model, x, False)
    ck.get_cuda_rng_tracker().set_states(dict(states))
    ck.configure(None, **MODES[mode])
    _assert_same(reference, _grads(model, x, True))
    # the tracker advanced past the forward's draws exactly as without checkpointing
    ck.get_cuda_rng_tracker().set_states(dict(states))
    again = _grads(model, x, False)
    _assert_same(reference, again)


def test_dropout_without_restoring_rng_would_differ():
    """The exactness above is not vacuous: a recompute with another RNG state changes the grads."""
    torch.manual_seed(0)
    model = nn.Sequential(MlpBlock(), MlpBlock())
    x = torch.randn(4, 8)
    reference = _grads(model, x, False)
    other = _grads(model, x, False, seed=124)
    assert not torch.equal(reference[2], other[2])


def test_non_reentrant_checkpoint_restores_the_tracker_too():
    torch.manual_seed(0)
    model = nn.Sequential(*[TransformerBlock(tracker_dropout=True) for _ in range(2)])
    x = torch.randn(2, 5, 16)
    ck.model_parallel_cuda_manual_seed(3)
    states = ck.get_cuda_rng_tracker().get_states()
    reference = _grads(model, x, False)
    ck.get_cuda_rng_tracker().set_states(dict(states))
    _assert_same(reference, _grads(model, x, True, checkpoint_fn=ck.non_reentrant_checkpoint))


def test_autocast_state_is_restored_for_the_recompute():
    torch.manual_seed(0)
    model = nn.Sequential(MlpBlock(), MlpBlock())
    x = torch.randn(4, 8)

    def run(use):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for block in model:
                h = ck.checkpoint(block, h) if use else block(h)
            loss = h.float().pow(2).mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    x.requires_grad_(True)
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


# ------------------------------------------------------------------------------ inputs and outputs
def test_tuple_outputs_non_tensor_args_and_kwargs():
    Pair = collections.namedtuple("Pair", "value aux")
    u = torch.randn(3, requires_grad=True)
    v = torch.randn(3, requires_grad=True)
    mask = torch.tensor([1, 0, 1])

    def f(a, b, label, mask, power=2):
        assert label == "x" and power == 3
        return (a * b ** power, label, (a + b).sum() * mask.sum(), mask * 2)

    out = ck.checkpoint(f, u, v, "x", mask, power=3)
    assert isinstance(out, tuple) and len(out) == 4 and out[1] == "x"
    assert out[0].requires_grad and not out[3].requires_grad and out[3].dtype == torch.long
    (out[0].sum() + out[2]).backward()
    u2, v2 = u.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    ref = f(u2, v2, "x", mask, power=3)
    (ref[0].sum() + ref[2]).backward()
    assert torch.equal(u.grad, u2.grad) and torch.equal(v.grad, v2.grad)

    one = ck.checkpoint(lambda a: (a * 2,), u)
    assert isinstance(one, tuple) and len(one) == 1
    pair = ck.checkpoint(lambda a: Pair(a * 2, 5), u)
    assert isinstance(pair, Pair) and pair.aux == 5
    listed = ck.checkpoint(lambda a: [a, 1], u * 1)
    assert isinstance(listed, list) and listed[1] == 1


def test_requires_grad_handling():
    layer = nn.Linear(4, 4)
    frozen_input = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="none of the inputs have requires_grad"):
        out = ck.checkpoint(layer, frozen_input)
    assert not out.requires_grad  # reentrant semantics: no input needs grad -> no graph
    # one input requires grad, the other not: only it gets a gradient, parameters get theirs
    a = torch.randn(2, 4, requires_grad=True)
    b = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ck.checkpoint(lambda p, q: layer(p) * q, a, b)
    out.sum().backward()
    assert a.grad is not None and b.grad is None and layer.weight.grad is not None
    # under no_grad the function just runs (nothing kept)
    with torch.no_grad():
        assert not ck.checkpoint(layer, a).requires_grad


def test_is_activation_to_checkpoint_and_detach_variable():
    assert ck.is_activation_to_checkpoint(torch.randn(2))
    assert not ck.is_activation_to_checkpoint(torch.tensor([1, 2]))
    marked = torch.randn(2)
    marked.no_checkpointing = True
    assert not ck.is_activation_to_checkpoint(marked)
    x = torch.randn(2, requires_grad=True)
    out = ck.detach_variable((x, 3))
    assert out[1] == 3 and out[0].requires_grad and out[0].grad_fn is None


# ------------------------------------------------------------------------------ RNG tracker
def test_rng_tracker_fork_reproduces_and_leaves_the_default_stream_alone():
    tracker = ck.CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("mp", 1234)
    plain = torch.rand(3)
    torch.manual_seed(0)
    states = tracker.get_states()
    with tracker.fork("mp"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), plain)  # the default generator did not move
    with tracker.fork("mp"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the fork's stream advanced
    tracker.set_states(states)
    with tracker.fork("mp"):
        assert torch.equal(torch.rand(3), first)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 1234)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert tracker.get_states() == {}


def test_model_parallel_cuda_manual_seed():
    class Mpu:
        def get_model_parallel_rank(self):
            return 1

        def get_model_parallel_world_size(self):
            return 1

        def get_model_parallel_group(self):
            return None

    ck.configure(Mpu())
    ck.model_parallel_cuda_manual_seed(5)
    tracker = ck.get_cuda_rng_tracker()
    assert list(tracker.get_states()) == ["model-parallel-rng"]
    with tracker.fork():
        forked = torch.rand(4)
    expected = torch.Generator().manual_seed(5 + 2718 + 1)
    assert torch.equal(forked, torch.rand(4, generator=expected))
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(5)))


# ------------------------------------------------------------------------------ contiguous buffers
def test_contiguous_buffers_are_reused_across_steps_and_checked():
    torch.manual_seed(0)
    model = nn.Sequential(*[MlpBlock() for _ in range(3)])
    x = torch.randn(4, 8)
    reference = _grads(model, x, False)
    ck.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    pointers = []
    for _ in range(3):
        _assert_same(reference, _grads(model, x, True))
        buffer = impl._BUFFERS.buffers[0]
        assert buffer.shape == (3, 4 * 8)
        pointers.append(buffer.data_ptr())
    assert len(set(pointers)) == 1
    # the kept input of each call is a row of that one buffer
    h = x.clone().requires_grad_(True)
    outs = []
    for block in model:
        h = ck.checkpoint(block, h)
        outs.append(h)
    kept = [o.grad_fn.plan[0][1] for o in outs]
    assert [k.data_ptr() for k in kept] == [buffer[i].data_ptr() for i in range(3)]
    h.sum().backward()
    # more calls per forward pass than rows: a clear error
    with pytest.raises(RuntimeError, match="num_checkpoints=3"):
        h = x.clone().requires_grad_(True)
        for block in list(model) * 2:
            h = ck.checkpoint(block, h)
    ck.reset()
    # a row overwritten by a second forward pass before the first one's backward: an error
    first = ck.checkpoint(model[0], x.clone().requires_grad_(True))
    impl._new_forward_pass()
    ck.checkpoint(model[0], x.clone().requires_grad_(True))
    with pytest.raises(RuntimeError, match="overwritten"):
        first.sum().backward()


def test_cpu_checkpointing_keeps_a_host_copy():
    ck.configure(None, checkpoint_in_cpu=True)
    x = torch.randn(3, 4, requires_grad=True)
    out = ck.checkpoint(lambda a: a.tanh(), x)
    kind, index, device, _ = out.grad_fn.plan[0]
    kept = out.grad_fn.saved_tensors[index]
    assert kind == "host" and kept.device.type == "cpu" and kept.data_ptr() != x.data_ptr()
    out.sum().backward()
    assert torch.allclose(x.grad, 1 - x.detach().tanh() ** 2)


# ------------------------------------------------------------------------------ configure
def test_configure_from_deepspeed_config_dict_path_and_text(tmp_path):
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}
    config = {"train_batch_size": 8, "activation_checkpointing": section}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    want = impl.CheckpointingSettings(True, True, 4, True, True, True)
    assert not ck.is_configured()
    for source in (config, str(path), json.dumps(config), dsplug.DeepSpeedConfig(config)):
        ck.configure(None, deepspeed_config=source)
        assert ck.is_configured() and ck.settings() == want
    # explicit arguments override the config
    ck.configure(None, deepspeed_config=config, contiguous_checkpointing=False, checkpoint_in_cpu=False, profile=False)
    assert ck.settings() == impl.CheckpointingSettings(True, False, 4, False, True, False)
    # absent keys: DeepSpeed's defaults
    ck.configure(None, deepspeed_config={"train_batch_size": 8})
    assert ck.settings() == impl.CheckpointingSettings()
    with pytest.raises(ValueError, match="partition_activations"):
        ck.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="num_checkpoints"):
        ck.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(dsplug.ConfigError, match="activation_checkpointing.number_checkpoints"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 0}})


def test_api_paths():
    from dsplug.runtime.activation_checkpointing import checkpointing as runtime_path
    from dsplug.unavailable import attribute_error, module_error

    for name in ("configure", "is_configured", "reset", "checkpoint", "get_cuda_rng_tracker",
                 "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker"):
        assert getattr(ck, name) is getattr(impl, name) is getattr(runtime_path, name)
    assert dsplug.runtime.activation_checkpointing.checkpointing is runtime_path
    assert "checkpoint" in dir(ck)
    assert module_error("deepspeed.checkpointing") is None
    assert module_error("deepspeed.runtime.activation_checkpointing.checkpointing") is None
    assert attribute_error("checkpointing") is None


# ------------------------------------------------------------------------------ config check
def _check_cli(capsys, tmp_path, section):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "activation_checkpointing": section}))
    code = cli_main(["config", "check", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_section_passes_config_check(tmp_path, capsys):
    code, out = _check_cli(capsys, tmp_path, {
        "partition_activations": True, "cpu_checkpointing": False, "contiguous_memory_optimization": True,
        "number_checkpoints": 6, "synchronize_checkpoint_boundary": False, "profile": True})
    assert code == 0, out
    code, out = _check_cli(capsys, tmp_path, {"contiguous_memory_optimization": True})
    assert code != 0
    assert "activation_checkpointing.contiguous_memory_optimization" in out
    assert "activation_checkpointing.number_checkpoints" in out
    code, out = _check_cli(capsys, tmp_path, {"partition_activation": True})
    assert code != 0 and "partition_activations" in out


class TestActivationCheckpointingObserver(ObserverContract):
    plugin_name = "activation_checkpointing"
    section = {"profile": True}
    steps = 2


# ------------------------------------------------------------------------------ the engine
def _lm(seed=0, layers=2):
    torch.manual_seed(seed)
    return CharTransformer(ModelConfig(vocab_size=17, seq_len=16, d_model=32, n_layers=layers, n_heads=2))


def checkpoint_blocks(model):
    """Run each block of the built-in LM through ``dsplug.checkpointing.checkpoint``."""
    for block in model.blocks:
        block.forward = lambda *args, _forward=block.forward: ck.checkpoint(_forward, *args)
    return model


class Recorder(Monitor):
    name = "recorder"

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events.extend(events)


def _train_lm(config, wrap, steps=3):
    model = _lm()
    if wrap:
        checkpoint_blocks(model)
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = dsplug.initialize(model=model, config={**base, **config})
    recorder = Recorder()
    engine.add_observer(recorder)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps * 2):
        tokens = torch.randint(0, 17, (2, 17), generator=g)
        loss = next_token_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return losses, params, recorder.events


def test_engine_configures_from_the_section_and_trains_the_builtin_lm_exactly(caplog):
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 2, "profile": True}
    reference = _train_lm({}, wrap=False)
    with caplog.at_level(logging.INFO):
        got = _train_lm({"activation_checkpointing": section}, wrap=True)
    assert ck.is_configured() and ck.settings() == impl.CheckpointingSettings(True, True, 2, True, False, True)
    assert got[0] == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], reference[1]))
    # profile: the monitors get the step's timings, the log a per-function line
    tags = collections.defaultdict(list)
    for tag, value, step in got[2]:
        tags[tag].append((step, value))
    assert [s for s, _ in tags["Train/Samples/activation_checkpoint_ms"]] == [4, 8, 12]
    assert all(v > 0 for _, v in tags["Train/Samples/activation_checkpoint_recompute_ms"])
    assert "Block.forward x4: forward" in caplog.text  # 2 blocks x 2 micro-steps per step
    # the contiguous buffers were allocated once for the whole run
    assert impl._BUFFERS.buffers[0].shape[0] == 2


def test_zero_stage3_gathers_parameters_for_the_recompute():
    zero = {"zero_optimization": {"stage": 3}}
    reference = _train_lm(zero, wrap=False, steps=2)
    got = _train_lm({**zero, "activation_checkpointing": {"partition_activations": True}}, wrap=True, steps=2)
    assert got[0] == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], reference[1]))


def test_no_section_leaves_the_api_unconfigured():
    losses, _, events = _train_lm({}, wrap=True, steps=1)
    assert not ck.is_configured()
    assert not any("activation_checkpoint" in tag for tag, _, _ in events)


# ------------------------------------------------------------------------------ partitioning over 2 ranks
PARTITION_OPTIONS = [{}, {"checkpoint_in_cpu": True, "contiguous_checkpointing": True, "num_checkpoints": 3}]


def _partitioned_rank():
    import torch

    import dsplug
    from dsplug import comm

    comm.init_distributed(dist_backend="gloo")
    group = dsplug.comm.new_group([0, 1])

    class Mpu:
        def get_model_parallel_rank(self):
            return comm.get_rank(group)

        def get_model_parallel_world_size(self):
            return comm.get_world_size(group)

        def get_model_parallel_group(self):
            return group

    ck = dsplug.checkpointing
    torch.manual_seed(0)  # the same model and data on both ranks, as model-parallel ranks see them
    model = torch.nn.Sequential(*[MlpBlock(width=5) for _ in range(3)])
    x = torch.randn(3, 5)  # 15 elements per activation: not divisible by 2 (padded)
    reference = _grads(model, x, False)
    results = []
    for options in PARTITION_OPTIONS:
        ck.configure(Mpu(), partition_activations=True, **options)
        got = _grads(model, x, True)
        out = ck.checkpoint(model[0], x.clone().requires_grad_(True))
        kept = out.grad_fn.plan[0][1]
        kept = out.grad_fn.saved_tensors[kept] if isinstance(kept, int) else kept
        out.sum().backward()
        same = (torch.equal(reference[0], got[0]) and all(torch.equal(a, b) for a, b in zip(reference[1], got[1]))
                and torch.equal(reference[2], got[2]))
        results.append((same, kept.numel(), kept.tolist()))
    return results


@pytest.mark.multiprocess
def test_partition_activations_over_two_ranks_gives_the_same_gradients():
    ranks = run_distributed(_partitioned_rank, 2)
    torch.manual_seed(0)
    torch.nn.Sequential(*[MlpBlock(width=5) for _ in range(3)])
    flat = torch.randn(3, 5).reshape(-1).tolist()
    for i, options in enumerate(PARTITION_OPTIONS):
        (same0, numel0, kept0), (same1, numel1, kept1) = ranks[0][i], ranks[1][i]
        assert same0 and same1, options
        assert numel0 == numel1 == 8, options  # ceil(15 / 2): each rank keeps its half
        assert kept0 == pytest.approx(flat[:8]) and kept1[:7] == pytest.approx(flat[8:]) and kept1[7] == 0
