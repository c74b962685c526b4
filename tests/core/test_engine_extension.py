"""The engine's extension points for subclasses (``before_zero_stage``, ``add_observer``), through the
example of docs/writing-plugins.md, which is executed here so the guide cannot rot."""
from __future__ import annotations

import re
import types

import pytest
import torch

from tests.conftest import REPO
from tests.engine_common import batch, loss_fn, make_model

GUIDE = REPO / "docs" / "writing-plugins.md"


def guide_example(marker: str) -> dict:
    """The names defined by the guide's python block that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{marker!r}: {len(found)} blocks of {GUIDE} hold it"
    namespace: dict = {"__name__": "guide_example"}
    exec(compile(found[0], str(GUIDE), "exec"), namespace)
    return namespace


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage}}


def train(engine, steps: int):
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, 0, 4)
            engine.backward(loss_fn(engine(x), y))
            engine.step()


def test_before_zero_stage_runs_after_the_placement_and_before_the_stage():
    from dsplug.engine import Engine

    seen = {}

    class Recording(Engine):
        def before_zero_stage(self, model):
            seen.update(stage_built=hasattr(self, "stage"), optimizer=hasattr(self, "optimizer"),
                        precision=self.precision is not None, module=self.module is model,
                        placed=next(model.parameters()).device == self.device)

    engine = Recording(model=make_model(), config=config(0))
    assert seen == {"stage_built": False, "optimizer": False, "precision": True, "module": True, "placed": True}
    engine.destroy()


def test_the_guides_engine_refuses_in_before_zero_stage_and_counts_steps():
    from dsplug.contracts.zero_stage import stage_of

    ShortEngine = guide_example("class ShortEngine(Engine)")["ShortEngine"]
    model = make_model()
    with pytest.raises(ValueError, match="ShortEngine: zero_optimization.stage 3 is not supported"):
        ShortEngine(model=model, config=config(3))
    assert stage_of(model) is None  # refused before any stage was built

    engine = ShortEngine(model=make_model(), config=config(2))
    train(engine, 3)
    assert engine.applied_steps == 3 and engine.global_steps == 3
    engine.destroy()


def test_initialize_builds_the_factorys_subclass(monkeypatch):
    """The engine-factory path of the guide: a plugin names the class, ``initialize`` builds it."""
    import dsplug
    from dsplug import hookimpl
    from dsplug.registry import get_registry

    ShortEngine = guide_example("class ShortEngine(Engine)")["ShortEngine"]

    class Tagged(torch.nn.Sequential):
        pass

    plugin = types.ModuleType("short_engine_plugin")

    @hookimpl
    def dsplug_engine_factory(model, mpu):
        return ShortEngine if isinstance(model, Tagged) else None

    plugin.dsplug_engine_factory = dsplug_engine_factory
    registry = get_registry()
    registry.pm.register(plugin, name="short_engine_plugin")
    try:
        engine, *_ = dsplug.initialize(model=Tagged(*make_model()), config=config(1))
        assert type(engine) is ShortEngine
        train(engine, 2)
        assert engine.applied_steps == 2
        engine.destroy()
        plain, *_ = dsplug.initialize(model=make_model(), config=config(1))
        assert type(plain) is dsplug.engine.Engine
        plain.destroy()
    finally:
        registry.pm.unregister(name="short_engine_plugin")


def test_add_observer_joins_a_checkpoint_participant(tmp_path):
    from dsplug import hookimpl
    from dsplug.engine import Engine

    class Notes:
        def __init__(self):
            self.text = "before"

        @hookimpl
        def dsplug_checkpoint_state(self, scope):
            return {"notes.text": self.text} if scope == "model" else None

        @hookimpl
        def dsplug_load_checkpoint_state(self, checkpoint):
            self.text = checkpoint.model["notes.text"]

    class WithNotes(Engine):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.notes = Notes()
            self.add_observer(self.notes, name="notes")

    engine = WithNotes(model=make_model(), config=config(0))
    engine.notes.text = "saved"
    engine.save_checkpoint(tmp_path)
    engine.destroy()
    again = WithNotes(model=make_model(), config=config(0))
    assert again.notes.text == "before"
    again.load_checkpoint(tmp_path)
    assert again.notes.text == "saved"
    again.destroy()


def test_the_guides_service_hook_example_counts_forward_flops():
    count_forward_flops = guide_example("def count_forward_flops(")["count_forward_flops"]
    model = torch.nn.Linear(8, 4, bias=False)
    assert count_forward_flops(model, torch.randn(3, 8)) == 2 * 3 * 8 * 4  # one multiply-add per weight and row
