"""The zero_stage and offload_device examples of docs/writing-plugins.md run as written: each is
loaded as a plugin module straight from the guide and passes its category's contract suite."""
from __future__ import annotations

import pathlib
import re
import types

import pytest

from dsplug.testing import OffloadDeviceContract, ZeroStageContract, tiny_engine, train_steps

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "writing-plugins.md"


def example(heading: str) -> types.ModuleType:
    """The first python block under ``## heading`` of the guide, executed as a module."""
    text = GUIDE.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end], re.DOTALL)
    assert blocks, f"docs/writing-plugins.md: no python example under '## {heading}'"
    module = types.ModuleType(f"writing_plugins_{heading}")
    exec(compile(blocks[0], f"{GUIDE}:{heading}", "exec"), module.__dict__)  # noqa: S102 - our own docs
    return module


STAGE4 = example("zero_stage")
RAMDISK = example("offload_device")


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
