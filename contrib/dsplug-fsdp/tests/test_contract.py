"""fsdp2 against dsplug's ZeRO-stage contract (one process: a world of one rank)."""
from __future__ import annotations

import dsplug_fsdp.plugin as plugin

from dsplug.testing import ZeroStageContract


class TestFsdp2Stage(ZeroStageContract):
    plugin_name = "fsdp2"
    # registered at runtime when the distribution is not installed (a no-op when it is)
    plugins = (plugin,)
    distribution = "dsplug-fsdp"
