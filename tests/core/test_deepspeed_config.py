"""``dsplug.runtime.config.DeepSpeedConfig``: the kernel answers its own keys, each feature's
attributes come from the plugin owning its section (``PluginSpec.deepspeed_config``), with
DeepSpeed's documented values."""
from __future__ import annotations

import ast
import warnings

import pytest

from dsplug import PluginSpec, hookimpl
from dsplug.config import DsplugConfig
from dsplug.config.schema import field, schema
from dsplug.registry import Registry, get_registry
from dsplug.runtime import constants
from dsplug.runtime.config import DeepSpeedConfig

from tests.conftest import REPO

BASE = {"train_batch_size": 4}

CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}


def ds(**sections) -> DeepSpeedConfig:
    return DeepSpeedConfig({**BASE, **sections}, world_size=1)


def test_progressive_layer_drop_attributes():
    on = ds(progressive_layer_drop={"enabled": True, "theta": 0.6, "gamma": 0.002})
    assert on.pld_enabled is True and on.pld_params == {"theta": 0.6, "gamma": 0.002}
    off = ds(progressive_layer_drop={"enabled": False, "theta": 0.6})
    assert off.pld_enabled is False and off.pld_params == {"theta": 0.6, "gamma": 0.001}  # the section, defaults filled
    absent = ds()
    assert absent.pld_enabled is False and absent.pld_params is False


def test_legacy_curriculum_attributes():
    on = ds(curriculum_learning=CURRICULUM)
    assert on.curriculum_enabled_legacy is True
    assert on.curriculum_params_legacy == {k: v for k, v in CURRICULUM.items() if k != "enabled"}
    absent = ds()
    assert absent.curriculum_enabled_legacy is False and absent.curriculum_params_legacy is False


def test_data_efficiency_attributes():
    on = ds(data_efficiency={"enabled": True, "seed": 7})
    assert on.data_efficiency_enabled is True
    assert on.data_efficiency_config["enabled"] is True and on.data_efficiency_config["seed"] == 7
    assert on.data_efficiency_config["data_sampling"]["enabled"] is False  # defaults filled in, as DeepSpeed's
    absent = ds()
    assert absent.data_efficiency_enabled is False and absent.data_efficiency_config["enabled"] is False


def test_precision_zero_elasticity_and_profiler_attributes():
    fp16 = ds(fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50},
              zero_optimization={"stage": 2}, flops_profiler={"enabled": True, "profile_step": 3})
    assert fp16.fp16_enabled and not fp16.bf16_enabled and not fp16.bfloat16_enabled and not fp16.amp_enabled
    assert fp16.initial_dynamic_scale == 2 ** 8 and fp16.loss_scale == 0
    assert fp16.dynamic_loss_scale_args["init_scale"] == 256 and fp16.dynamic_loss_scale_args["scale_window"] == 50
    assert fp16.zero_optimization_stage == 2 and fp16.zero_enabled and int(fp16.zero_config.stage) == 2
    assert fp16.flops_profiler_config.enabled and fp16.flops_profiler_config.profile_step == 3
    assert fp16.elasticity_enabled is False
    static = ds(fp16={"enabled": True, "loss_scale": 128})
    assert static.loss_scale == 128 and static.dynamic_loss_scale_args is None
    bf16 = ds(bf16={"enabled": True})
    assert bf16.bf16_enabled and bf16.bfloat16_enabled and not bf16.fp16_enabled and bf16.fp16_auto_cast is None
    amp = ds(amp={"enabled": True, "opt_level": "O1"})
    assert amp.amp_enabled and amp.amp_params["opt_level"] == "O1" and "enabled" not in amp.amp_params
    plain = ds()
    assert plain.zero_optimization_stage == 0 and plain.zero_enabled is False and plain.amp_params is False
    assert plain.eigenvalue_enabled is False and plain.sequence_parallel_size == 1  # features dsplug lacks


def test_monitor_config_is_an_object_with_every_monitor_section():
    config = ds(csv_monitor={"enabled": True, "output_path": "/tmp/x"})
    monitors = config.monitor_config
    assert (monitors.csv_monitor.enabled, monitors.csv_monitor.output_path) == (True, "/tmp/x")
    assert monitors.enabled is True
    # absent sections: their schemas' defaults (DeepSpeed's: disabled, job name DeepSpeedJobName)
    assert (monitors.tensorboard.enabled, monitors.tensorboard.job_name) == (False, "DeepSpeedJobName")
    assert ds().monitor_config.enabled is False


def test_the_kernel_module_names_no_plugin_section():
    """core/runtime/config.py answers the kernel's keys only: no plugin's section appears in it,
    neither as a string nor through a constant of dsplug.runtime.constants."""
    plugin_sections = set(get_registry().sections())
    assert {"fp16", "zero_optimization", "progressive_layer_drop", "data_efficiency"} <= plugin_sections
    tree = ast.parse((REPO / "core" / "runtime" / "config.py").read_text())
    # _dtype maps the values of the kernel key communication_data_type ("fp16" the dtype, not the section)
    tree.body = [node for node in tree.body if getattr(node, "name", None) != "_dtype"]
    assert any(getattr(node, "name", None) == "DeepSpeedConfig" for node in tree.body)
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    via_constants = {name for name in names if getattr(constants, name, None) in plugin_sections}
    assert strings & plugin_sections == set() and via_constants == set()


# --------------------------------------------------------------------------- a third party's attributes
@schema
class ShinyConfig:
    enabled: bool = field(False, doc="turn the shiny feature on")
    level: int = field(1, ge=0, doc="how shiny")


def _shiny_attributes(config):
    section = config.sections.get("shiny")
    return {"shiny_enabled": bool(section and section.enabled), "shiny_level": section.level if section else None}


class ShinyPlugin:
    @hookimpl
    def dsplug_config_sections(self):
        return [PluginSpec(category="section", name="shiny", section="shiny", schema=ShinyConfig,
                           deepspeed_config=_shiny_attributes)]


class GreedyPlugin:
    @hookimpl
    def dsplug_config_sections(self):
        return [PluginSpec(category="section", name="greedy", section="greedy", schema=ShinyConfig,
                           deepspeed_config=lambda config: {"train_batch_size": 999, "greedy_on": True})]


class BrokenPlugin:
    @hookimpl
    def dsplug_config_sections(self):
        def fail(config):
            raise KeyError("oops")

        return [PluginSpec(category="section", name="broken", section="broken", schema=ShinyConfig,
                           deepspeed_config=fail)]


def _registry(*plugins) -> Registry:
    registry = Registry(blocked=(), entry_points=[])
    for plugin in plugins:
        registry.register(plugin, distribution="shiny-dist")
    return registry


def test_a_third_party_section_answers_its_attributes():
    registry = _registry(ShinyPlugin())
    config = DeepSpeedConfig(DsplugConfig({**BASE, "shiny": {"enabled": True, "level": 3}}, world_size=1,
                                          registry=registry), world_size=1)
    assert config.shiny_enabled is True and config.shiny_level == 3
    assert config.train_batch_size == 4
    without = DeepSpeedConfig(DsplugConfig(dict(BASE), world_size=1, registry=registry), world_size=1)
    assert without.shiny_enabled is False and without.shiny_level is None


def test_clashing_and_failing_answers_are_reported_and_the_rest_kept():
    registry = _registry(GreedyPlugin(), BrokenPlugin(), ShinyPlugin())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DeepSpeedConfig(DsplugConfig(dict(BASE), world_size=1, registry=registry), world_size=1)
    messages = [str(w.message) for w in caught]
    assert config.train_batch_size == 4 and config.greedy_on is True and config.shiny_enabled is False
    assert any("DeepSpeedConfig.train_batch_size" in m and "section:greedy" in m and "the kernel" in m
               for m in messages)
    assert any("section:broken" in m and "KeyError" in m for m in messages)


def test_an_attribute_nothing_answers_says_so():
    registry = _registry()
    config = DeepSpeedConfig(DsplugConfig(dict(BASE), world_size=1, registry=registry), world_size=1)
    assert config.eigenvalue_enabled is False  # dsplug.unavailable answers the features dsplug lacks
    with pytest.raises(AttributeError, match="'pld_enabled'.*neither the kernel nor an installed plugin"):
        config.pld_enabled
