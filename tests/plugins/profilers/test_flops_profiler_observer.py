"""The ``flops_profiler`` config section and the observer that profiles one training step.

The observer is driven through a pluggy manager with the lifecycle hookspecs, the way the
engine calls it, with a small fake engine (``module``, ``global_steps``) stepping by hand.
"""
from __future__ import annotations

import re

import pluggy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dsplug.config.schema import ConfigError, describe, parse, to_dict
from dsplug.context import BuildContext
from dsplug.hookspecs import PROJECT, LifecycleSpecs
from dsplug.plugins.profilers.flops_profiler.config import FlopsProfilerConfig
from dsplug.plugins.profilers.flops_profiler.patching import installed_patch
from dsplug.plugins.profilers.flops_profiler.factories import build_observer
from dsplug.registry import get_registry

BATCH, DIN, HIDDEN = 4, 6, 10
MLP_MACS = BATCH * (DIN * HIDDEN + HIDDEN * 1)

DEEPSPEED_DEFAULTS = {"enabled": False, "recompute_fwd_factor": 0.0, "profile_step": 1, "module_depth": -1,
                      "top_modules": 1, "detailed": True, "output_file": None}


# ----------------------------------------------------------------------------- config
def test_schema_has_every_documented_key_with_deepspeed_default():
    assert to_dict(parse(FlopsProfilerConfig, {})) == DEEPSPEED_DEFAULTS
    assert {row[0] for row in describe(FlopsProfilerConfig)} == set(DEEPSPEED_DEFAULTS)
    given = {"enabled": True, "recompute_fwd_factor": 0.5, "profile_step": 3, "module_depth": 2,
             "top_modules": 3, "detailed": False, "output_file": "prof.txt"}
    assert to_dict(parse(FlopsProfilerConfig, given)) == given


@pytest.mark.parametrize("section,path,message", [
    ({"profile_stp": 2}, "flops_profiler.profile_stp", "did you mean 'flops_profiler.profile_step'"),
    ({"enabled": "yes"}, "flops_profiler.enabled", "expected a boolean"),
    ({"profile_step": 0}, "flops_profiler.profile_step", "must be >= 1"),
    ({"module_depth": -2}, "flops_profiler.module_depth", "must be >= -1"),
    ({"top_modules": 0}, "flops_profiler.top_modules", "must be >= 1"),
    ({"recompute_fwd_factor": 1.5}, "flops_profiler.recompute_fwd_factor", "must be <= 1.0"),
    ({"detailed": 2}, "flops_profiler.detailed", "expected a boolean"),
    ({"output_file": ""}, "flops_profiler.output_file", "must be a file path, or null"),
    ({"output_file": 3}, "flops_profiler.output_file", "expected a string or null"),
])
def test_schema_errors_name_the_key(section, path, message):
    with pytest.raises(ConfigError) as info:
        parse(FlopsProfilerConfig, section, "flops_profiler")
    text = str(info.value)
    assert path in text and message in text


def test_registered_as_the_owner_of_the_flops_profiler_section():
    provided = get_registry().get("observer", "flops_profiler")
    assert provided.spec.section == "flops_profiler"
    assert provided.spec.schema is FlopsProfilerConfig
    assert get_registry().section_owner("flops_profiler") is not None


def test_factory_builds_an_observer_only_when_enabled():
    context = BuildContext()
    assert build_observer(None, context) is None
    assert build_observer(parse(FlopsProfilerConfig, {}), context) is None
    assert build_observer({"enabled": False}, context) is None
    assert build_observer({"enabled": True}, context) is not None
    with pytest.raises(ConfigError, match="top_modules"):
        build_observer({"enabled": True, "top_modules": -1}, context)


# ----------------------------------------------------------------------------- observer
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


class FakeEngine:
    """Calls the lifecycle hooks in the engine's order around plain PyTorch training."""

    def __init__(self, config: dict, rank: int = 0, accumulation: int = 1):
        self.module = mlp()
        self.global_steps = 0
        self.accumulation = accumulation
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.01)
        self.observer = build_observer(config, BuildContext(rank=rank, world_size=2 if rank else 1))
        self.bus = pluggy.PluginManager(PROJECT)
        self.bus.add_hookspecs(LifecycleSpecs)
        if self.observer is not None:
            self.bus.register(self.observer)

    def train_step(self, metrics=None, fail_forward=False):
        for _ in range(self.accumulation):
            self.bus.hook.dsplug_forward_begin(engine=self)
            if fail_forward:
                raise RuntimeError("forward failed")
            out = self.module(torch.randn(BATCH, DIN))
            self.bus.hook.dsplug_forward_end(engine=self, output=out)
            out.pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_steps += 1
        self.bus.hook.dsplug_step_end(engine=self, metrics=dict(metrics or {}, global_steps=self.global_steps))

    def close(self):
        self.bus.hook.dsplug_engine_closed(engine=self)


def summary_value(text, label):
    match = re.search(rf"^{re.escape(label)}:\s+(.*)$", text, re.M)
    return match.group(1) if match else None


def test_profiles_exactly_the_configured_step(capsys):
    engine = FakeEngine({"enabled": True, "profile_step": 2})
    engine.train_step()
    assert capsys.readouterr().out == ""
    engine.train_step()
    text = capsys.readouterr().out
    assert text.count("Profile Summary at step 2:") == 1
    assert summary_value(text, "fwd MACs per GPU") == f"{MLP_MACS} MACs"
    assert summary_value(text, "params per GPU") == str(DIN * HIDDEN + HIDDEN + HIDDEN + 1)
    assert summary_value(text, "batch size per GPU") == str(BATCH)
    for label in ("fwd latency", "iter latency", "FLOPS per GPU = 3 * fwd flops per GPU / iter latency"):
        assert summary_value(text, label) is not None, label
    assert "Detailed Profile per GPU" in text and "(0): Linear(" in text
    assert engine.observer.last_text == text
    assert installed_patch() is None and F.linear is torch._C._nn.linear
    assert not engine.module[0]._forward_hooks
    engine.train_step()
    assert capsys.readouterr().out == ""  # one step only


def test_wall_clock_breakdown_and_recompute_factor_in_the_summary(capsys):
    engine = FakeEngine({"enabled": True, "recompute_fwd_factor": 0.5, "detailed": False})
    engine.train_step(metrics={"forward_ms": 1.0, "backward_ms": 5.0, "step_ms": 0.25})
    text = capsys.readouterr().out
    assert summary_value(text, "bwd latency") == "5 ms"
    assert summary_value(text, "step latency") == "250 us"
    flops = 2 * MLP_MACS + BATCH * HIDDEN
    bwd_flops = summary_value(text, "bwd FLOPS per GPU = (2 + 0.5) * fwd flops per GPU / bwd latency")
    assert flops == 600 and bwd_flops == "300 KFLOPS"  # 2.5 * 600 / 5 ms
    assert summary_value(text, "fwd+bwd FLOPS per GPU = (3 + 0.5) * fwd flops per GPU / (fwd+bwd latency)")
    assert "Detailed Profile" not in text


def test_gradient_accumulation_counts_one_micro_batch_and_times_the_whole_step(capsys):
    engine = FakeEngine({"enabled": True, "detailed": False}, accumulation=3)
    engine.train_step(metrics={"backward_ms": 6.0})
    text = capsys.readouterr().out
    assert summary_value(text, "fwd MACs per GPU") == f"{MLP_MACS} MACs"
    assert summary_value(text, "micro-steps (forward+backward passes) in the step") == "3"
    assert summary_value(text, "bwd latency") == "2 ms"  # 6 ms over 3 micro-steps
    assert summary_value(text, "FLOPS per GPU = 3 * fwd flops per GPU * 3 / iter latency") is not None


def test_output_file_and_module_depth(tmp_path, capsys):
    target = tmp_path / "out" / "flops.txt"
    engine = FakeEngine({"enabled": True, "output_file": str(target), "module_depth": 0, "top_modules": 2})
    engine.train_step()
    assert capsys.readouterr().out == ""
    text = target.read_text()
    assert "Profile Summary at step 1:" in text
    assert "depth 0:" in text and "depth 1:" not in text


def test_only_rank_zero_profiles(capsys, tmp_path):
    target = tmp_path / "flops.txt"
    engine = FakeEngine({"enabled": True, "output_file": str(target)}, rank=1)
    engine.train_step()
    assert not target.exists() and capsys.readouterr().out == ""
    assert installed_patch() is None


def test_disabled_section_registers_nothing(capsys):
    engine = FakeEngine({"enabled": False})
    assert engine.observer is None
    engine.train_step()
    assert capsys.readouterr().out == ""


def test_failed_forward_and_close_leave_torch_untouched(capsys):
    engine = FakeEngine({"enabled": True, "profile_step": 1})
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.train_step(fail_forward=True)
    assert installed_patch() is not None  # the profile of the failed step is still open
    engine.train_step()  # the retried step is measured from scratch
    text = capsys.readouterr().out
    assert summary_value(text, "fwd MACs per GPU") == f"{MLP_MACS} MACs"
    assert installed_patch() is None

    engine = FakeEngine({"enabled": True})
    engine.bus.hook.dsplug_forward_begin(engine=engine)
    assert installed_patch() is not None
    engine.close()
    assert installed_patch() is None and F.linear is torch._C._nn.linear
    assert "_dsplug_flops_profile" not in engine.module[0].__dict__


def test_with_the_real_engine(capsys):
    import dsplug

    model = mlp()
    config = {"train_micro_batch_size_per_gpu": BATCH, "wall_clock_breakdown": True,
              "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False}}
    engine, *_ = dsplug.initialize(model=model, config=config,
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    for _ in range(3):
        loss = engine(torch.randn(BATCH, DIN)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    text = capsys.readouterr().out
    assert text.count("Flops Profiler") == 1 and "Profile Summary at step 2:" in text
    assert summary_value(text, "fwd MACs per GPU") == f"{MLP_MACS} MACs"
    assert summary_value(text, "world size") == "1" and summary_value(text, "bwd latency") is not None
    assert installed_patch() is None
