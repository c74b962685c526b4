"""Every hook implementation is called the way pluggy calls it: with the arguments it declares.

A hook implementation may take any subset of its hook's arguments (pluggy's rule, and what
``dsplug.hookspecs`` promises). The hooks whose answers the kernel needs one implementation at a
time (``dsplug_forward_begin``, ``dsplug_engine_methods``, ``dsplug_dataloader_options``,
``dsplug_batch_sizes``, the category and service hooks, the checkpoint-state probe of
``dsplug.testing``) go through :func:`dsplug.events.call_impl`; each is tried here with an
implementation taking no argument and one taking a part of them, against what the hook does, and
a failing implementation is still named in the error.
"""
from __future__ import annotations

import pluggy
import pytest
import torch

from dsplug.events import PluginHookError, call_each, call_impl
from dsplug.hookspecs import PROJECT, hookimpl, hookspec
from dsplug.testing import make_registry, plugin_state, tiny_batch, tiny_engine, tiny_model


class KeywordModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = tiny_model()

    def forward(self, x, scale=1.0):
        return self.inner(x) * scale


class Named:
    def __init__(self, name):
        self.__name__ = name


# ------------------------------------------------------------------------------ dsplug_forward_begin
class ScaleNoArguments(Named):
    @hookimpl
    def dsplug_forward_begin(self):
        return {"scale": 2.0}


class ScaleFromEngine(Named):
    @hookimpl
    def dsplug_forward_begin(self, engine):
        return {"scale": float(engine.global_steps + 3)}


@pytest.mark.parametrize("plugin, factor", [(ScaleNoArguments("tests.scale_none"), 2.0),
                                            (ScaleFromEngine("tests.scale_engine"), 3.0)])
def test_forward_begin_with_any_subset_of_its_arguments(plugin, factor):
    model = KeywordModel()
    engine = tiny_engine(model=model, registry=make_registry(plugin))
    x, _ = tiny_batch(0)
    torch.testing.assert_close(engine(x), model.inner(x) * factor)


# ------------------------------------------------------------------------------ dsplug_engine_methods
class MethodNoArguments(Named):
    @hookimpl
    def dsplug_engine_methods(self):
        return {"answer_without_engine": lambda: 42}


def test_engine_methods_without_arguments():
    engine = tiny_engine(registry=make_registry(MethodNoArguments("tests.method_none")))
    assert engine.answer_without_engine() == 42


# ------------------------------------------------------------------------------ dsplug_dataloader_options
class IndexDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor(i)


class EveryThirdNoArguments(Named):
    @hookimpl
    def dsplug_dataloader_options(self):
        return {"batch_sampler": [[i, i + 3] for i in range(0, 12, 6)]}


class FromBatchSize(Named):
    @hookimpl
    def dsplug_dataloader_options(self, batch_size, dataset):  # a subset, in another order
        return {"batch_sampler": [list(range(i, i + batch_size)) for i in range(0, len(dataset), 8)]}


def test_dataloader_options_with_any_subset_of_its_arguments():
    none = tiny_engine(registry=make_registry(EveryThirdNoArguments("tests.third")), training_data=IndexDataset())
    assert [b.tolist() for b in none.training_dataloader] == [[0, 3], [6, 9]]
    some = tiny_engine(registry=make_registry(FromBatchSize("tests.by_size")), training_data=IndexDataset())
    assert [b.tolist() for b in some.training_dataloader] == [[0, 1], [8, 9]]  # micro-batch 2 (tiny_config)


# ------------------------------------------------------------------------------ failures name the plugin
class Raises(Named):
    @hookimpl
    def dsplug_forward_begin(self):
        raise KeyError("no such thing")

    @hookimpl
    def dsplug_engine_methods(self):
        return {}


def test_a_failing_implementation_is_named():
    engine = tiny_engine(registry=make_registry(Raises("tests.raises")))
    with pytest.raises(PluginHookError, match=r"plugin '<test>:tests.raises' raised in dsplug_forward_begin: KeyError"
                       ) as info:
        engine(tiny_batch(0)[0])
    assert info.value.plugin == "<test>:tests.raises" and info.value.hook == "dsplug_forward_begin"


class RaisesInMethods(Named):
    @hookimpl
    def dsplug_engine_methods(self, engine):
        raise ValueError("broken")


def test_a_failing_engine_methods_implementation_is_named():
    with pytest.raises(PluginHookError, match="plugin '<test>:tests.raises_methods' raised in dsplug_engine_methods"):
        tiny_engine(registry=make_registry(RaisesInMethods("tests.raises_methods")))


# ------------------------------------------------------------------------------ the batch-size and category hooks
class BatchesWithoutWorld(Named):
    @hookimpl
    def dsplug_batch_sizes(self, config):
        return {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2} if config.raw else None


def test_batch_sizes_with_a_subset_of_its_arguments():
    from dsplug.config import DsplugConfig

    config = DsplugConfig({"steps_per_print": 5}, world_size=1,
                          registry=make_registry(BatchesWithoutWorld("tests.batches")))
    assert (config.kernel.train_batch_size, config.kernel.train_micro_batch_size_per_gpu,
            config.kernel.gradient_accumulation_steps) == (6, 3, 2)


class StateWithoutOptions(Named):
    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {f"tests.{scope}": 1}


def test_checkpoint_state_probe_with_a_subset_of_its_arguments():
    part = StateWithoutOptions("tests.state")
    engine = tiny_engine()
    engine.add_observer(part, name="tests.state")
    assert plugin_state(engine, part) == {"model": {"tests.model": 1}, "rank": {"tests.rank": 1}}


# ------------------------------------------------------------------------------ the helper itself
class Specs:
    @hookspec
    def dsplug_demo(self, a, b):
        """two arguments"""


def _manager(*plugins):
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(Specs)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return pm


class TakesB:
    @hookimpl
    def dsplug_demo(self, b):
        return ("b", b)


class TakesNone:
    @hookimpl(tryfirst=True)
    def dsplug_demo(self):
        return ("none",)


class Wraps:
    @hookimpl(wrapper=True)
    def dsplug_demo(self, a):
        return (yield)


def test_call_each_agrees_with_pluggy_in_order_and_arguments():
    pm = _manager(TakesB(), TakesNone(), TakesB())
    pluggy_answers = pm.hook.dsplug_demo(a=1, b=2)
    ours = [answer for _impl, answer in call_each(pm.hook.dsplug_demo, {"a": 1, "b": 2})]
    assert ours == pluggy_answers == [("none",), ("b", 2), ("b", 2)]
    assert [impl.plugin_name for impl, _ in call_each(pm.hook.dsplug_demo, {"a": 1, "b": 2})] == ["p1", "p2", "p0"]
    only, = call_each(pm.hook.dsplug_demo, {"a": 1, "b": 2}, plugin=pm.get_plugin("p2"))
    assert only[0].plugin_name == "p2"


def test_call_impl_refuses_wrappers_and_missing_arguments_naming_the_plugin():
    pm = _manager(Wraps(), TakesB())
    wrapper = next(i for i in pm.hook.dsplug_demo.get_hookimpls() if i.plugin_name == "p0")
    with pytest.raises(PluginHookError, match="plugin 'p0' implements dsplug_demo as a hook wrapper"):
        call_impl(wrapper, {"a": 1, "b": 2})
    plain = next(i for i in pm.hook.dsplug_demo.get_hookimpls() if i.plugin_name == "p1")
    with pytest.raises(TypeError, match=r"dsplug_demo was called without 'b', which plugin 'p1' takes"):
        call_impl(plain, {"a": 1})
