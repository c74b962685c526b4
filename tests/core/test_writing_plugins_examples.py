"""The zero_stage and offload_device examples of docs/writing-plugins.md run as written: each is
loaded as a plugin module straight from the guide (through the doc-test markers of
tests/core/test_doc_examples.py, which also trains each one) and passes its category's contract
suite."""
from __future__ import annotations

import pytest

from dsplug.testing import OffloadDeviceContract, ZeroStageContract, tiny_engine, train_steps
from tests.core.test_doc_examples import plugin_example

STAGE4 = plugin_example("stage4.py")
RAMDISK = plugin_example("ramdisk.py")


class TestGuideStage4(ZeroStageContract):
    plugin_name = "4"
    plugins = (STAGE4,)
    distribution = "docs/writing-plugins.md"


class TestGuideRamDisk(OffloadDeviceContract):
    plugin_name = "ramdisk"
    plugins = (RAMDISK,)
    distribution = "docs/writing-plugins.md"


def test_stage4_is_selected_by_the_config_and_reports_deepspeeds_number():
    engine = tiny_engine({"zero_optimization": {"stage": 4}}, plugins=(STAGE4,))
    try:
        assert type(engine.stage).__name__ == "AllReduceStage"
        assert engine.zero_optimization_stage() == 0  # its traits: partitions nothing
        train_steps(engine, 2)
    finally:
        engine.destroy()


def test_ramdisk_holds_stage2s_offloaded_optimizer():
    engine = tiny_engine({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "ramdisk"}},
                          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}, plugins=(RAMDISK,))
    try:
        master = engine.stage.opt_params[0]
        device = engine.stage.offload.device
        assert type(device).__name__ == "RamDisk" and device.dir is not None
        stored = engine.stage.offload.stored[0]
        assert master.data_ptr() == device.tensor(stored).data_ptr()  # the optimizer steps the mapped file
        train_steps(engine, 2)
    finally:
        engine.destroy()


def test_stage4_refuses_16bit_training_with_its_message():
    with pytest.raises(ValueError, match="stage 4 trains in fp32 only"):
        tiny_engine({"zero_optimization": {"stage": 4}, "bf16": {"enabled": True}}, plugins=(STAGE4,))
