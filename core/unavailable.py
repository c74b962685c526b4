"""DeepSpeed names dsplug does not provide, each with the reason, so that a DeepSpeed script that
reaches one gets a clear error naming the feature instead of ``AttributeError`` or
``No module named ...``.

Two readers:

* ``dsplug.__getattr__`` -- top-level names (``deepspeed.init_inference`` when the script did
  ``import dsplug as deepspeed``, or ``import deepspeed`` with the alias enabled);
* the kernel's import finder (:mod:`dsplug.api_paths`) -- modules (``import dsplug.module_inject``,
  and ``import deepspeed.module_inject`` with the alias enabled, whose finder maps it to dsplug's).

Both consult these tables only for a name dsplug does not have, so a feature implemented later
wins over its row here (delete the row then). The errors are ``ImportError`` subclasses (the
module one a ``ModuleNotFoundError``), which ``from deepspeed import X`` and availability probes
(``try: import ... except ImportError``) expect; an ``AttributeError`` would lose the message in
``from deepspeed import X``. The price: ``hasattr(deepspeed, "init_inference")`` raises instead
of returning False for the names listed here.
"""
from __future__ import annotations

from typing import Dict, Optional


class NotAvailableInDsplug(ImportError):
    """A DeepSpeed name (function, class or module) that dsplug does not implement."""


class ModuleNotAvailableInDsplug(NotAvailableInDsplug, ModuleNotFoundError):
    """A DeepSpeed module that dsplug does not implement."""


#: feature key -> (what it is, why / what to use instead)
FEATURES: Dict[str, str] = {
    "inference": "DeepSpeed-Inference (init_inference, InferenceEngine, kernel injection) is not implemented: "
                 "dsplug is a training engine; run inference on the trained torch module (engine.module)",
    "autotp": "automatic tensor parallelism (AutoTP: tp_model_init, deepspeed.module_inject, the 'tensor_parallel' "
              "config section) is not implemented: dsplug shards with data parallelism and ZeRO stages 1-3",
    "sequence": "Ulysses sequence parallelism (deepspeed.sequence) is not implemented: dsplug parallelizes over "
                "data (with ZeRO stages 1-3) only",
    "linear": "DeepSpeed's LoRA / quantized linear layers (deepspeed.linear) are not implemented: use peft",
    "kernels": "DeepSpeed's fused CUDA model kernels (transformer, model implementations) are "
               "not implemented: dsplug's native ops are the optimizer, I/O and sparse attention ops under deepspeed.ops",
    "env_report": "deepspeed.env_report is not available: run 'dsplug report'",
    "wrapper_optimizers": "DeepSpeed wraps the client optimizer in a mixed-precision or ZeRO optimizer (FP16_Optimizer, "
                          "FP16_UnfusedOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer, "
                          "DeepSpeedZeroOptimizer_Stage3) and engine.optimizer is that wrapper; in dsplug mixed precision "
                          "and ZeRO partitioning are the engine's precision and ZeRO-stage plugins "
                          "(engine.precision, engine.stage), and engine.optimizer has the wrapper's shape "
                          "without being one (dsplug.optimizer_view.WrappedOptimizer: .optimizer is the base "
                          "optimizer, .overflow, .loss_scale), so no engine.optimizer is an instance of this class",
    "sparse_matmul": "DeepSpeed's Triton block-sparse MatMul / Softmax classes (deepspeed.ops.sparse_attention.matmul, "
                     ".softmax) are not provided: use SparseSelfAttention, which runs dsplug's native block-sparse "
                     "kernels (docs/sparse-attention.md)",
}

#: DeepSpeed module -> feature key (a submodule of a listed module is covered by its row)
MODULES: Dict[str, str] = {
    "deepspeed.inference": "inference",
    "deepspeed.model_implementations": "kernels",
    "deepspeed.module_inject": "autotp",
    "deepspeed.sequence": "sequence",
    "deepspeed.runtime.sequence_parallel": "sequence",
    "deepspeed.linear": "linear",
    "deepspeed.ops.transformer": "kernels",
    "deepspeed.ops.sparse_attention.matmul": "sparse_matmul",
    "deepspeed.ops.sparse_attention.softmax": "sparse_matmul",
    "deepspeed.env_report": "env_report",
}

#: DeepSpeed top-level attribute -> feature key (modules in MODULES one level down are covered too)
NAMES: Dict[str, str] = {
    "init_inference": "inference",
    "InferenceEngine": "inference",
    "DeepSpeedInferenceConfig": "inference",
    "default_inference_config": "inference",
    "replace_transformer_layer": "inference",
    "revert_transformer_layer": "inference",
    "tp_model_init": "autotp",
}


#: ``DeepSpeedConfig`` attributes of DeepSpeed features dsplug lacks, with their "off" values: a
#: config cannot turn these features on (their sections are refused), so the values are true.
#: A plugin implementing one answers the attribute itself (``PluginSpec.deepspeed_config``).
CONFIG_ATTRIBUTES: Dict[str, object] = {
    "eigenvalue_enabled": False,  # the 'eigenvalue' section
    "sequence_parallel_size": 1,  # Ulysses sequence parallelism
    "compile_config": None,  # DeepSpeed's torch.compile integration ('compile' section)
}


def unavailable_class(name: str, module: str, feature: str) -> type:
    """A DeepSpeed class dsplug does not implement, under its name at its import path: importing it
    works (``isinstance(x, cls)`` is False for every object dsplug makes), constructing it raises
    :class:`NotAvailableInDsplug` with the reason from :data:`FEATURES`."""
    message = _message(f"{module.replace('dsplug.', 'deepspeed.', 1)}.{name}", feature)

    def __new__(cls, *args, **kwargs):
        raise NotAvailableInDsplug(message, name=module)

    return type(name, (), {"__new__": __new__, "__module__": module, "__doc__": message})


def _message(what: str, feature: str) -> str:
    return f"{what} is not available in dsplug: {FEATURES[feature]}"


def attribute_error(name: str) -> Optional[NotAvailableInDsplug]:
    """The error for ``deepspeed.<name>`` / ``dsplug.<name>``, or None when the table has no row."""
    feature = NAMES.get(name) or MODULES.get(f"deepspeed.{name}")
    if feature is None:
        return None
    return NotAvailableInDsplug(_message(f"deepspeed.{name} (dsplug.{name})", feature), name=f"dsplug.{name}")


def module_error(fullname: str) -> Optional[ModuleNotAvailableInDsplug]:
    """The error for importing the DeepSpeed module ``fullname`` (``deepspeed.module_inject.auto_tp``,
    or the same under ``dsplug.``), or None when neither it nor a parent has a row."""
    head, _, rest = fullname.partition(".")
    if head not in ("deepspeed", "dsplug") or not rest:
        return None
    parts = f"deepspeed.{rest}".split(".")
    for i in range(len(parts), 1, -1):
        feature = MODULES.get(".".join(parts[:i]))
        if feature is not None:
            what = f"the module deepspeed.{rest} (dsplug.{rest})"
            return ModuleNotAvailableInDsplug(_message(what, feature), name=fullname)
    return None
