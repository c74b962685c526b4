"""Pipeline parallelism: DeepSpeed's ``deepspeed.pipe`` (``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``), ``deepspeed.runtime.pipe`` (``.module``, ``.topology``, ``.engine``,
``.schedule``) and the ``PipelineEngine`` that ``dsplug.initialize`` returns for a
``PipelineModule``.

* :mod:`.topology` -- ``ProcessTopology`` and DeepSpeed's pipe/data/model topologies; the
  ``PipelineParallelGrid`` (process groups, the mpu interface);
* :mod:`.partition` -- stage boundaries ('parameters', 'uniform', 'type:REGEX');
* :mod:`.module` -- ``PipelineModule``, layer specs, tied weights, per-layer checkpoint files;
* :mod:`.schedule` -- the 1F1B training schedule and the inference schedule;
* :mod:`.p2p` -- activations and gradients between stages over ``dsplug.comm`` send / recv;
* :mod:`.engine` -- ``PipelineEngine``: the ordinary engine per stage, driven by the schedule;
* :mod:`.checkpoint` -- checkpoints that reload at another stage count.

Registered through two service hooks: ``dsplug_api_modules`` (the import paths) and
``dsplug_engine_factory`` (``initialize`` builds a ``PipelineEngine`` for a ``PipelineModule``).
Importing this module is cheap (no torch).
"""
import sys

from dsplug import hookimpl
from dsplug.descriptors import ApiModule


@hookimpl
def dsplug_api_modules():
    return [ApiModule("dsplug.pipe", "dsplug.plugins.pipe.api"),
            ApiModule("dsplug.runtime.pipe", "dsplug.plugins.pipe.api"),
            ApiModule("dsplug.runtime.pipe.module", "dsplug.plugins.pipe.module"),
            ApiModule("dsplug.runtime.pipe.topology", "dsplug.plugins.pipe.topology"),
            ApiModule("dsplug.runtime.pipe.engine", "dsplug.plugins.pipe.engine"),
            ApiModule("dsplug.runtime.pipe.schedule", "dsplug.plugins.pipe.schedule")]


@hookimpl
def dsplug_engine_factory(model, mpu):
    """A ``PipelineModule`` is trained by the ``PipelineEngine`` (the module cannot be one unless
    its module was imported, so nothing is imported for other models)."""
    module = sys.modules.get("dsplug.plugins.pipe.module")
    if module is None or not isinstance(model, module.PipelineModule):
        return None
    from .engine import PipelineEngine

    return PipelineEngine
