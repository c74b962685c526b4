"""Random-LTD (``data_efficiency.data_routing.random_ltd``): the layer wrapper against an
independent reference (the layer run on the kept tokens, picked by plain indexing), gradients,
eval mode, the kept-token schedule per wrapped layer per step through the engine (and its
checkpoint), the built-in LM training end to end, and DeepSpeed's documented example section on
a 24-layer model in ``seq_batch_dim`` order with an ``attention_mask`` keyword."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dsplug.plugins.data_efficiency.schedules import random_ltd_value
from dsplug.plugins.train.model import Block, CharTransformer, ModelConfig, next_token_loss
from dsplug.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from dsplug.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd, save_without_random_ltd
from dsplug.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from dsplug.testing import ObserverContract, tiny_engine
from tests.conftest import REPO

DATA = REPO / "tests" / "data" / "data_efficiency"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MaskedMixer(nn.Module):
    """``x + softmax(q(x) x^T / sqrt(H), masked) v(x)`` over ``[B, S, H]`` (``[S, B, H]`` when
    ``seq_first``); ``attention_mask`` is boolean (True = attend), broadcastable to ``[B, 1, S, S]``;
    ``causal``: a causal mask of its own (by position in its input, like ``is_causal=True``).
    Records the sequence length of each call."""

    def __init__(self, hidden: int = 8, seq_first: bool = False, causal: bool = False):
        super().__init__()
        self.q, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.seq_first, self.causal = seq_first, causal
        self.seen = []

    def forward(self, x, attention_mask=None):
        if self.seq_first:
            x = x.transpose(0, 1)
        self.seen.append(x.shape[1])
        scores = self.q(x) @ x.transpose(1, 2) / math.sqrt(x.shape[-1])
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask[:, 0], -1e9)
        if self.causal:
            scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), -1e9)
        out = x + scores.softmax(-1) @ self.v(x)
        return out.transpose(0, 1) if self.seq_first else out


def ltd_config(**over):
    config = {"enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 1, "random_ltd_layer_id": [0],
              "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
              "random_ltd_schedule": {"min_value": 6, "max_value": 16, "schedule_type": "fixed_linear",
                                      "schedule_config": {"require_steps": 10, "seq_per_step": 2}}}
    config.update(over)
    return config


B, S, H, R = 4, 16, 8, 6


def wrapped(order: str, kept: int = R, causal: bool = False):
    torch.manual_seed(0)
    layer = MaskedMixer(H, seq_first=order == "seq_batch_dim", causal=causal)
    wrapper = RandomLayerTokenDrop(layer)
    config = ltd_config(hidden_state_order=order)
    scheduler = RandomLTDScheduler(config)
    scheduler.set_current_seq(kept)
    wrapper.init_config(config, scheduler, 0)
    return wrapper, layer


def masks(kind: str):
    if kind == "implicit":  # the layer is causal by itself: the kept tokens must keep their order
        return None
    if kind == "causal":
        return torch.ones(S, S, dtype=torch.bool).tril()[None, None]  # shared [1, 1, S, S]
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 11:] = False
    pad[3, 5:] = False
    return pad[:, None, None, :]  # [B, 1, 1, S]


def sub_mask(mask, kind: str, b: int, pos):
    if mask is None:
        return None
    if kind == "causal":
        return mask[0, 0][pos][:, pos][None, None]
    return mask[b, 0, 0][pos][None, None, None]


def batch_first(t, order):
    return t if order == "batch_seq_dim" else t.transpose(0, 1)


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
@pytest.mark.parametrize("kind", ["causal", "padding", "implicit"])
def test_kept_tokens_equal_the_layer_on_the_gathered_subset_and_dropped_ones_pass_through(order, kind):
    wrapper, layer = wrapped(order, causal=kind == "implicit")
    torch.manual_seed(1)
    x = torch.randn(B, S, H)
    x_in = batch_first(x, order).contiguous()  # the layout the layer takes
    mask = masks(kind)
    out = wrapper(x_in, attention_mask=mask)
    assert out.shape == x_in.shape
    out = batch_first(out, order)
    changed = (out != x).any(-1)
    assert changed.sum(1).tolist() == [R] * B  # R kept tokens per sample, the rest untouched
    assert len({tuple(changed[b].nonzero().flatten().tolist()) for b in range(B)}) > 1  # chosen per sample
    torch.testing.assert_close(out[~changed], x[~changed], rtol=0, atol=0)
    reference = copy.deepcopy(layer)
    for b in range(B):
        pos = changed[b].nonzero().flatten()  # ascending: the kept tokens in their order
        xb = x[b, pos][None]
        expect = reference(batch_first(xb, order), attention_mask=sub_mask(mask, kind, b, pos))
        torch.testing.assert_close(out[b, pos], batch_first(expect, order)[0])


def test_gradients_flow_through_the_layer_only_for_kept_tokens():
    wrapper, layer = wrapped("batch_seq_dim")
    torch.manual_seed(2)
    x = torch.randn(B, S, H, requires_grad=True)
    g = torch.randn(B, S, H)
    mask = masks("causal")
    out = wrapper(x, attention_mask=mask)
    (out * g).sum().backward()
    kept = (out.detach() != x.detach()).any(-1)
    torch.testing.assert_close(x.grad[~kept], g[~kept], rtol=0, atol=0)  # identity for dropped tokens
    reference = copy.deepcopy(layer)
    reference.zero_grad()
    ref_x = x.detach().clone().requires_grad_(True)
    total = 0
    for b in range(B):
        pos = kept[b].nonzero().flatten()
        total = total + (reference(ref_x[b, pos][None], attention_mask=sub_mask(mask, "causal", b, pos))[0]
                         * g[b, pos]).sum()
    total.backward()
    torch.testing.assert_close(x.grad[kept], ref_x.grad[kept])
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_eval_mode_and_full_length_use_every_token():
    wrapper, layer = wrapped("batch_seq_dim")
    x = torch.randn(B, S, H)
    wrapper.eval()
    torch.testing.assert_close(wrapper(x, attention_mask=masks("causal")), layer(x, attention_mask=masks("causal")))
    wrapper.train()
    wrapper.random_ltd_scheduler.set_current_seq(S + 5)
    torch.testing.assert_close(wrapper(x), layer(x))
    assert layer.seen[-1] == S


# ---------------------------------------------------------------------------------------- through the engine
class Stack(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(MaskedMixer(H) for _ in range(layers))

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask)
        return x


def engine_config(ltd, **extra):
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD",
                                                                                        "params": {"lr": 0.01}},
            "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd}}, **extra}


def train(engine, steps, make_input):
    for step in range(steps):
        out = engine(make_input(step))
        engine.backward(out.pow(2).mean())
        engine.step()


def seq_input(step):
    return torch.randn(2, S, H, generator=torch.Generator().manual_seed(step))


def test_tokens_per_wrapped_layer_per_step_follow_the_schedule_and_checkpoint(tmp_path):
    ltd = ltd_config(random_ltd_layer_num=2, random_ltd_layer_id=[1, 3])
    ltd["random_ltd_schedule"] = {"min_value": 4, "max_value": S, "schedule_type": "fixed_linear",
                                  "schedule_config": {"require_steps": 6, "seq_per_step": 4}}
    model = convert_to_random_ltd(Stack(), MaskedMixer)
    engine = tiny_engine(engine_config(ltd), model=model, optimizer=None)
    assert engine.random_ltd_enabled() and engine.random_ltd_num_layer() == 2
    train(engine, 5, seq_input)
    engine.save_checkpoint(tmp_path)
    train(engine, 4, lambda s: seq_input(s + 5))
    layers = [w.random_ltd_layer for w in model.layers]
    expected = [random_ltd_value(step, 4, S, 6, 4) for step in range(9)]
    assert expected[0] == 4 and expected[-1] == S and len(set(expected)) >= 3
    assert layers[1].seen == expected and layers[3].seen == expected
    assert layers[0].seen == [S] * 9 and layers[2].seen == [S] * 9
    state = engine.random_ltd_scheduler.state_dict()
    assert state["consumed_layer_tokens"] == sum(2 * (v * 2 + S * 2) for v in expected)

    resumed_model = convert_to_random_ltd(Stack(), MaskedMixer)
    resumed = tiny_engine(engine_config(ltd), model=resumed_model, optimizer=None)
    resumed.load_checkpoint(tmp_path)
    assert resumed.random_ltd_scheduler.get_current_seq() == expected[5]
    train(resumed, 4, lambda s: seq_input(s + 5))
    assert resumed_model.layers[1].random_ltd_layer.seen == expected[5:]
    assert resumed.random_ltd_scheduler.state_dict() == state


def test_layer_ids_beyond_the_wrapped_layers_are_an_error_and_late_conversion_works():
    ltd = ltd_config(random_ltd_layer_num=1, random_ltd_layer_id=[3])
    with pytest.raises(Exception, match=r"names layer\(s\) \[3\], but the model has 2"):
        tiny_engine(engine_config(ltd), model=convert_to_random_ltd(Stack(2), MaskedMixer), optimizer=None)
    engine = tiny_engine(engine_config(ltd), model=Stack(), optimizer=None)  # not wrapped yet: a warning only
    convert_to_random_ltd(engine, MaskedMixer)  # Megatron-DeepSpeed converts the engine
    train(engine, 1, seq_input)
    assert engine.module.layers[3].random_ltd_layer.seen == [6] and engine.module.layers[0].random_ltd_layer.seen == [S]
    assert set(save_without_random_ltd(engine)) == set(Stack().state_dict())


def test_builtin_lm_trains_with_random_ltd_on_its_blocks():
    torch.manual_seed(0)
    model = CharTransformer(ModelConfig(vocab_size=16, seq_len=32, d_model=32, n_layers=3, n_heads=2))
    convert_to_random_ltd(model, Block)
    ltd = ltd_config(total_layer_num=3, random_ltd_layer_num=2, random_ltd_layer_id=[1, 2], model_mask_name=None)
    ltd["random_ltd_schedule"] = {"min_value": 8, "max_value": 32, "schedule_type": "fixed_linear",
                                  "schedule_config": {"require_steps": 8, "seq_per_step": 8}}
    config = engine_config(ltd)
    config.update(train_batch_size=4, train_micro_batch_size_per_gpu=4,
                  optimizer={"type": "Adam", "params": {"lr": 3e-3}})
    engine = tiny_engine(config, model=model, optimizer=None)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (4, 33), generator=g)
    losses, kept = [], []
    for _ in range(12):
        loss = next_token_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        kept.append([b.reserved_length for b in model.blocks])
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3
    assert kept[0] == [None, 8, 8] and kept[4] == [None, 16, 16] and kept[-1] == [None, 32, 32]
    model.eval()
    assert model(tokens[:, :-1]).shape == (4, 32, 16)


@pytest.mark.filterwarnings("ignore::dsplug.config.dsconfig.DsplugConfigWarning")
def test_reference_example_random_ltd_on_a_24_layer_seq_batch_model():
    """DeepSpeed's documented section as is (its curriculum part off: placeholder paths); the
    model has 24 tiny layers taking ``[S, B, H]`` and an ``attention_mask`` keyword."""
    config = json.loads((DATA / "reference_example.json").read_text())
    config["data_efficiency"]["data_sampling"]["enabled"] = False
    config.update(train_batch_size=2, train_micro_batch_size_per_gpu=2,
                  optimizer={"type": "SGD", "params": {"lr": 0.01}})

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(MaskedMixer(4, seq_first=True) for _ in range(24))

        def forward(self, x):  # x: [B, S, H]
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()[None, None]
            x = x.transpose(0, 1)
            for layer in self.layers:
                x = layer(x, attention_mask=mask)
            return x.transpose(0, 1)

    model = convert_to_random_ltd(SeqFirst(), MaskedMixer)
    engine = tiny_engine(config, model=model, optimizer=None)
    train(engine, 2, lambda s: torch.randn(2, 256, 4, generator=torch.Generator().manual_seed(s)))
    seen = [w.random_ltd_layer.seen for w in model.layers]
    assert seen[0] == seen[23] == [256, 256]
    assert all(s == [128, 128] for s in seen[1:23])


@pytest.mark.filterwarnings("ignore::dsplug.config.dsconfig.DsplugConfigWarning")  # the typo test turns it off
class TestDataEfficiencyObserverContract(ObserverContract):
    """The plugin's observer against the contract suite (config check, typo, engine run, checkpoint
    round trip, resumed run, destroy); random-LTD on the suite's MLP has no layers to wrap, so the
    schedule state is what is checked."""

    plugin_name = "data_efficiency"
    section = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": ltd_config()}}
    steps = 4

    def trace(self, engine):
        return engine.random_ltd_scheduler.get_current_seq()
