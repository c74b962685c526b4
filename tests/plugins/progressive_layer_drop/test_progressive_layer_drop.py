"""Progressive layer dropping (the ``progressive_layer_drop`` section): theta(t) follows
``(1 - theta) * exp(-gamma * t) + theta`` with DeepSpeed's step (updated at each boundary with
the pre-step global step), every training forward gets ``progressive_layer_drop=True,
pld_theta=theta(t)``, a resumed run continues exactly, DeepSpeed's engine accessors work, the
built-in LM drops block i with probability i / L * (1 - theta), and the documented example checks
and trains through ``dsplug train --config FILE``."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dsplug.cli import main as cli_main
from dsplug.config import check_config
from dsplug.plugins.train.model import CharTransformer, ModelConfig
from dsplug.testing import ObserverContract, tiny_engine, tiny_model, train_steps

#: DeepSpeed's documented progressive_layer_drop block (its defaults)
DOC_EXAMPLE = {"enabled": True, "theta": 0.5, "gamma": 0.001}
TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--sample-chars", "0"]


def closed_form(t, theta, gamma):
    return (1 - theta) * math.exp(-gamma * t) + theta


class ThetaModel(torch.nn.Module):
    """tiny_model whose output depends on ``pld_theta``, recording the keywords it gets."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_model()
        self.seen = []

    def forward(self, x, progressive_layer_drop=False, pld_theta=None):
        self.seen.append((progressive_layer_drop, pld_theta))
        return self.inner(x) * (pld_theta if pld_theta is not None else 1.0)


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_theta_follows_the_formula_and_reaches_the_model():
    theta, gamma = 0.3, 0.4
    model = ThetaModel()
    engine = tiny_engine({"progressive_layer_drop": {"enabled": True, "theta": theta, "gamma": gamma},
                          "gradient_accumulation_steps": 2, "train_batch_size": 4}, model=model)
    assert engine.get_pld_theta() == 1.0
    after = []
    train_steps(engine, 5, on_step=lambda e: after.append(e.get_pld_theta()))
    # after step g+1 (global_steps g+1): theta(g); the forwards of step g use theta(g - 1), 1.0 at g = 0
    assert after == pytest.approx([closed_form(g, theta, gamma) for g in range(5)], rel=1e-15)
    forward_thetas = [1.0] + [closed_form(g - 1, theta, gamma) for g in range(1, 5)]
    assert model.seen == [(True, pytest.approx(t, rel=1e-15)) for t in forward_thetas for _ in range(2)]
    assert (engine.pld_enabled(), engine.pld_params(), engine.pld_theta(), engine.pld_gamma()) == \
        (True, {"theta": theta, "gamma": gamma}, theta, gamma)

    engine.eval()  # eval forwards get nothing (DeepSpeed passes the keywords only in training mode)
    engine(torch.zeros(2, 8))
    engine.train()
    engine(torch.zeros(2, 8), pld_theta=0.25)  # the caller's keyword wins
    assert model.seen[-2:] == [(False, None), (True, 0.25)]
    engine.destroy()


def test_engine_without_pld():
    model = ThetaModel()
    engine = tiny_engine({"progressive_layer_drop": {"enabled": False}}, model=model)
    train_steps(engine, 1)
    assert model.seen == [(False, None)]
    assert engine.pld_enabled() is False and engine.get_pld_theta() is None
    assert engine.pld_params() == {"theta": 0.5, "gamma": 0.001}
    engine.destroy()
    plain = tiny_engine()
    assert plain.pld_params() is False and plain.get_pld_theta() is None
    plain.destroy()


class TestProgressiveLayerDrop(ObserverContract):
    """Discovery, config check and typo path, the bus, checkpoint round trip (the losses depend
    on theta, so the resumed run matches only with the right theta)."""

    plugin_name = "progressive_layer_drop"
    section = {"enabled": True, "theta": 0.4, "gamma": 0.3}
    steps = 4

    def make_engine(self, **kwargs):
        kwargs.setdefault("model", ThetaModel())
        return super().make_engine(**kwargs)

    def trace(self, engine):
        return (engine.module.seen[-1], engine.get_pld_theta())


# ------------------------------------------------------------------------------ the built-in LM
def test_builtin_model_keeps_block_i_with_probability_1_minus_i_over_L_times_1_minus_theta():
    torch.manual_seed(0)
    model = CharTransformer(ModelConfig(vocab_size=16, seq_len=8, d_model=16, n_layers=4, n_heads=2))
    ran = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda module, args, out, i=i: ran.append(i))
    tokens = torch.randint(0, 16, (2, 8))
    theta = 0.2
    keep = [1 - i / 4 * (1 - theta) for i in range(1, 5)]
    patterns = set()
    for seed in range(12):
        ran.clear()
        torch.manual_seed(seed)
        out = model(tokens, progressive_layer_drop=True, pld_theta=theta)
        torch.manual_seed(seed)
        draws = [float(torch.rand(())) for _ in range(4)]  # one draw per block, in order
        assert ran == [i for i in range(4) if draws[i] < keep[i]]
        patterns.add(tuple(ran))
        # kept blocks scale their residual branches by 1 / p_i
        x = model.token_embedding(tokens) + model.position_embedding(torch.arange(8))
        for i in ran:
            x = x + model.blocks[i].attn(model.blocks[i].ln_attn(x)) / keep[i]
            x = x + model.blocks[i].mlp(model.blocks[i].ln_mlp(x)) / keep[i]
        torch.testing.assert_close(out, model.head(model.ln_final(x)))
    assert len(patterns) > 3
    model.eval()  # evaluation: every block, unscaled
    ran.clear()
    torch.testing.assert_close(model(tokens, progressive_layer_drop=True, pld_theta=theta), model(tokens))
    assert ran == [0, 1, 2, 3] * 2


# ------------------------------------------------------------------------------ config and dsplug train
def test_documented_example_checks_and_trains_the_builtin_lm(tmp_path, capsys, monkeypatch, keep_threads):
    config = tmp_path / "pld.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 0.006}},
                                  "progressive_layer_drop": DOC_EXAMPLE}))
    assert cli_main(["config", "check", str(config)]) == 0, capsys.readouterr()
    seen = []
    forward = CharTransformer.forward

    def recording(self, tokens, **kwargs):
        if self.training:
            seen.append(kwargs)
        return forward(self, tokens, **kwargs)

    monkeypatch.setattr(CharTransformer, "forward", recording)
    code = cli_main(["train", "--config", str(config), "--steps", "3", "--output-dir", str(tmp_path / "out"), *TINY])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "done: 3 steps" in out.out and "nan" not in out.out.lower()
    thetas = [1.0, 1.0, closed_form(1, 0.5, 0.001)]
    assert seen == [{"progressive_layer_drop": True, "pld_theta": pytest.approx(t, rel=1e-15)} for t in thetas]


@pytest.mark.parametrize("change,path,words", [
    ({"theta": 0}, "progressive_layer_drop.theta", "must be > 0"),
    ({"theta": 1.5}, "progressive_layer_drop.theta", "must be <= 1"),
    ({"gamma": -0.1}, "progressive_layer_drop.gamma", "must be >= 0"),
    ({"gama": 0.1}, "progressive_layer_drop.gama", "did you mean 'progressive_layer_drop.gamma'"),
    ({"enabled": "yes"}, "progressive_layer_drop.enabled", "expected a boolean"),
])
def test_bad_config_names_the_key(change, path, words):
    error = check_config({"train_micro_batch_size_per_gpu": 1, "progressive_layer_drop": {**DOC_EXAMPLE, **change}},
                         world_size=1)
    assert error is not None
    issues = {issue.path: issue.message for issue in error.issues}
    assert path in issues and words in issues[path], str(error)
