"""``dsplug.runtime.pipe`` (DeepSpeed's ``deepspeed.runtime.pipe``): ``PipelineModule``,
``LayerSpec``, ``TiedLayerSpec``, ``ProcessTopology`` ... and the submodules ``module``,
``topology``, ``engine``, ``schedule`` (imported on first use).

The names come from the installed plugin that declares these paths through the
``dsplug_api_modules`` hook (dsplug's own: the pipeline plugin); see :mod:`dsplug.public`.
"""
import importlib

from dsplug.public import forward_to_plugin

_SUBMODULES = {"module", "topology", "engine", "schedule"}
_forward, _forward_dir = forward_to_plugin(__name__)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _forward(name)


def __dir__():
    return sorted(set(_forward_dir()) | _SUBMODULES)
