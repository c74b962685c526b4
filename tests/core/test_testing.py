"""dsplug.testing: built-in plugins run the contract suites, a toy compression method defined
here runs the compression suite through a real engine (checkpoint included), and the suites
catch broken plugins."""
from __future__ import annotations

import csv
import glob
import os

import pytest
import torch

from dsplug import PluginSpec, hookimpl
from dsplug.config.schema import field, schema
from dsplug.contracts import CompressionMethod, Monitor
from dsplug.testing import (
    CompressionContract,
    MonitorContract,
    ObserverContract,
    OptimizerContract,
    PrecisionContract,
    SchedulerContract,
    SectionContract,
    assert_state_equal,
    contract_problems,
    make_registry,
    tiny_engine,
    train_steps,
)


# ------------------------------------------------------------------------------ built-ins
class TestAdamW(OptimizerContract):
    plugin_name = "AdamW"
    section = {"lr": 0.01, "weight_decay": 0.01}

    def reference_optimizer(self, params):
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


class TestWarmupLR(SchedulerContract):
    plugin_name = "WarmupLR"
    section = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"}


class TestCsvMonitor(MonitorContract):
    plugin_name = "csv_monitor"
    section = {"enabled": True, "output_path": "{tmp_path}", "job_name": "job"}

    def read_back(self, tmp_path):
        events = []
        for path in glob.glob(os.path.join(tmp_path, "job", "*.csv")):
            with open(path, newline="") as f:
                rows = list(csv.reader(f))
            tag = "Train/Samples/" + rows[0][1]
            events += [(tag, float(value), int(step)) for step, value in rows[1:]]
        return events


class TestCommsLogger(ObserverContract):
    plugin_name = "comms_logger"
    section = {"enabled": True}


class TestFp16(PrecisionContract):
    plugin_name = "fp16"
    section = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}


class TestZeroSection(SectionContract):
    plugin_name = "zero_optimization"
    section = {"stage": 0}


# ------------------------------------------------------------------------------ a toy compression method
@schema
class MagnitudeMaskConfig:
    sparsity: float = field(0.5, ge=0.0, lt=1.0, doc="fraction of each Linear weight zeroed")
    schedule_offset: int = field(2, ge=0, doc="first optimizer step that prunes")
    update_every: int = field(2, ge=1, doc="recompute the masks every this many steps after the offset")


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    k = int(weight.numel() * sparsity)
    if k == 0:
        return torch.ones_like(weight, dtype=torch.bool)
    threshold = weight.detach().abs().flatten().kthvalue(k).values
    return weight.detach().abs() > threshold


class MagnitudeMask(CompressionMethod):
    """Zeroes the smallest weights of every Linear from ``schedule_offset`` on, recomputing the
    masks every ``update_every`` steps and re-applying them after every step. State: the masks
    and how often they were computed."""

    def __init__(self, config=None, context=None):
        super().__init__(config, context)
        self.layers = []
        self.masks = None
        self.updates = 0
        self.last_step = 0

    def compress(self, model):
        self.layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        return model

    def on_step(self, global_steps):
        self.last_step = int(global_steps)
        offset, every = self.config.schedule_offset, self.config.update_every
        if global_steps < offset:
            return
        if self.masks is None or (global_steps - offset) % every == 0:
            self.masks = [magnitude_mask(layer.weight, self.config.sparsity) for layer in self.layers]
            self.updates += 1
        with torch.no_grad():
            for layer, mask in zip(self.layers, self.masks):
                layer.weight.mul_(mask)

    def state_dict(self):
        return {"masks": None if self.masks is None else [m.clone() for m in self.masks],
                "updates": self.updates, "last_step": self.last_step}

    def load_state_dict(self, state):
        self.masks = None if state["masks"] is None else [m.clone() for m in state["masks"]]
        self.updates = state["updates"]
        self.last_step = state["last_step"]


class ToyPlugins:
    """Plugins not installed through an entry point: registered at runtime by the suites."""

    __name__ = "tests.core.test_testing.toy"

    @hookimpl
    def dsplug_compression_methods(self):
        return [PluginSpec(category="compression", name="magnitude_mask", factory=MagnitudeMask,
                           schema=MagnitudeMaskConfig, summary="toy magnitude pruning with a schedule")]


TOY = ToyPlugins()


class TestMagnitudeMask(CompressionContract):
    plugin_name = "magnitude_mask"
    plugins = (TOY,)
    section = {"sparsity": 0.5, "schedule_offset": 1, "update_every": 2}
    steps = 4

    def check_trained(self, engine, losses):
        method = self.part(engine)
        assert method.updates == 2 and method.last_step == 4  # masks computed at steps 1 and 3
        for layer, mask in zip(method.layers, method.masks):
            assert (layer.weight[~mask] == 0).all()
            assert mask.float().mean() == pytest.approx(0.5, abs=0.05)


def test_compression_state_is_in_the_shared_checkpoint_file(tmp_path):
    registry = make_registry(TOY)
    config = {"compression_training": {"magnitude_mask": {"schedule_offset": 1}}}
    engine = tiny_engine(config, registry=registry)
    train_steps(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    shared = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=True)
    assert shared["compression.magnitude_mask"]["updates"] == 1
    fresh = tiny_engine(config, registry=registry)
    fresh.load_checkpoint(str(tmp_path), tag="t")
    assert_state_equal(fresh.compression[0].state_dict(), engine.compression[0].state_dict())
    engine.destroy()
    fresh.destroy()


# ------------------------------------------------------------------------------ the suites have teeth
class ForgetfulMonitor(Monitor):
    """Contributes state to checkpoints but never takes it back."""

    def __init__(self):
        self.count = 0

    def write_events(self, events):
        self.count += len(events)

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {"forgetful.count": self.count} if scope == "model" else None


@schema
class ForgetfulConfig:
    enabled: bool = field(False)


class ForgetfulPlugins:
    __name__ = "tests.core.test_testing.forgetful"

    @hookimpl
    def dsplug_monitors(self):
        return [PluginSpec(category="monitor", name="forgetful", section="forgetful", schema=ForgetfulConfig,
                           factory=lambda section, context: ForgetfulMonitor() if section.enabled and
                           context.rank == 0 else None)]

    @hookimpl
    def dsplug_schedulers(self):
        return [PluginSpec(category="scheduler", name="ForgetfulLR", schema=ForgetfulConfig,
                           factory=lambda optimizer, params, context: ForgetfulLR(optimizer))]


class ForgetfulLR(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, optimizer):
        super().__init__(optimizer, lambda step: 1.0 / (1 + step))

    def load_state_dict(self, state_dict):
        pass


FORGETFUL = ForgetfulPlugins()


class ForgetfulMonitorSuite(MonitorContract):
    plugin_name = "forgetful"
    plugins = (FORGETFUL,)


class ForgetfulSchedulerSuite(SchedulerContract):
    plugin_name = "ForgetfulLR"
    plugins = (FORGETFUL,)


def run_suite_test(suite_cls, test_name, tmp_path, monkeypatch):
    suite = suite_cls()
    monkeypatch.chdir(tmp_path)
    suite.tmp_path, suite._engines = tmp_path, []
    try:
        getattr(suite, test_name)()
    finally:
        for engine in suite._engines:
            if not getattr(engine, "_dsplug_contract_destroyed", False):
                engine.destroy()


@pytest.mark.parametrize("suite_cls", [ForgetfulMonitorSuite, ForgetfulSchedulerSuite])
def test_round_trip_catches_state_not_restored(suite_cls, tmp_path, monkeypatch):
    run_suite_test(suite_cls, "test_factory_builds_the_contract", tmp_path, monkeypatch)  # otherwise fine
    with pytest.raises(AssertionError, match="after load"):
        run_suite_test(suite_cls, "test_checkpoint_round_trip_and_resume", tmp_path, monkeypatch)


def test_typo_check_names_the_path(tmp_path, monkeypatch):
    run_suite_test(ForgetfulMonitorSuite, "test_typo_in_config_names_its_path", tmp_path, monkeypatch)
    suite = ForgetfulMonitorSuite()
    suite.tmp_path = tmp_path
    assert suite._typo() == ("enabledd", "enabled")


def test_contract_problems_name_what_is_missing():
    class NotAMonitor:
        pass

    class BadHook(Monitor):
        def write_events(self, events):
            pass

        @hookimpl
        def dsplug_step_end(self, metrix):  # no such argument
            pass

    assert contract_problems("monitor", NotAMonitor())[0].endswith("has no write_events")
    assert any("do not match dsplug.hookspecs" in p for p in contract_problems("monitor", BadHook()))
    assert contract_problems("scheduler", object())[0].startswith("object lacks part of dsplug.contracts.LRScheduler")
    assert contract_problems("compression", MagnitudeMask()) == []
