"""Hooks that extend the engine's surface: dsplug_forward_begin may add keyword arguments to the
model's forward (curriculum_seqlen, progressive_layer_drop / pld_theta; the caller's own keywords
win, a keyword from two plugins is an error naming it), and dsplug_engine_methods adds DeepSpeed
engine methods that belong to a feature (never shadowing the engine's own)."""
from __future__ import annotations

import pytest
import torch

from dsplug.events import PluginHookError
from dsplug.hookspecs import hookimpl
from dsplug.testing import make_registry, tiny_batch, tiny_engine, tiny_model


class KeywordModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_model()
        self.seen = []

    def forward(self, x, scale=1.0, shift=0.0):
        self.seen.append((scale, shift))
        return self.inner(x) * scale + shift


class AddsScale:
    __name__ = "tests.adds_scale"

    @hookimpl
    def dsplug_forward_begin(self, engine):
        return {"scale": 2.0}


class AddsScaleToo:
    __name__ = "tests.adds_scale_too"

    @hookimpl
    def dsplug_forward_begin(self, engine):
        return {"scale": 3.0}


def test_a_plugin_adds_forward_keywords_and_the_caller_wins():
    model = KeywordModel()
    engine = tiny_engine(model=model, registry=make_registry(AddsScale()))
    x, _ = tiny_batch(0)
    torch.testing.assert_close(engine(x), model.inner(x) * 2.0)
    engine(x, scale=5.0, shift=1.0)
    assert model.seen == [(2.0, 0.0), (5.0, 1.0)]


def test_two_plugins_adding_one_keyword_is_an_error_naming_it():
    engine = tiny_engine(model=KeywordModel(), registry=make_registry(AddsScale(), AddsScaleToo()))
    with pytest.raises(PluginHookError, match="both add the forward keyword 'scale'"):
        engine(tiny_batch(0)[0])


class AddsMethod:
    __name__ = "tests.adds_method"

    def __init__(self, name="set_custom_thing"):
        self.name = name
        self.calls = []

    @hookimpl
    def dsplug_engine_methods(self, engine):
        return {self.name: lambda *args, **kwargs: self.calls.append((engine, args, kwargs)) or "done"}


def test_a_plugin_adds_an_engine_method():
    plugin = AddsMethod()
    engine = tiny_engine(registry=make_registry(plugin))
    assert engine.set_custom_thing(1, key=2) == "done"
    assert plugin.calls == [(engine, (1,), {"key": 2})]
    with pytest.raises(AttributeError):
        engine.not_a_method_anyone_added


def test_a_plugin_method_may_not_shadow_the_engine():
    with pytest.raises(PluginHookError, match="adds the engine method 'step', which 'the engine itself' already"):
        tiny_engine(registry=make_registry(AddsMethod("step")))
