"""The names of ``dsplug.pipe`` / ``dsplug.runtime.pipe`` (DeepSpeed's ``deepspeed.pipe`` and
``deepspeed.runtime.pipe``)."""
from .engine import PipelineEngine  # noqa: F401
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec  # noqa: F401
from .topology import (PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology,  # noqa: F401
                       ProcessTopology)

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineEngine", "PipelineError", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]
