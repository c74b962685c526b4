"""Every built-in ZeRO stage passes dsplug.testing.ZeroStageContract."""
from __future__ import annotations

from dsplug.testing import ZeroStageContract


class TestStage0(ZeroStageContract):
    plugin_name = "0"


class TestStage1(ZeroStageContract):
    plugin_name = "1"


class TestStage2(ZeroStageContract):
    plugin_name = "2"


class TestStage3(ZeroStageContract):
    plugin_name = "3"
    section = {"stage3_param_persistence_threshold": 0}  # every parameter partitioned, gathered per use
