"""DeepSpeed's ``deepspeed.ops`` names, backed by dsplug's native ops (or their pure-torch
fallbacks): ``dsplug.ops.adam.DeepSpeedCPUAdam``, ``dsplug.ops.adagrad.DeepSpeedCPUAdagrad``,
``dsplug.ops.lion.DeepSpeedCPULion``, ``dsplug.ops.op_builder.AsyncIOBuilder``, ``dsplug.ops.aio``.

Submodules, the kernel's and those plugins declare (``dsplug.ops.sparse_attention``,
``dsplug.ops.lamb``), are imported on first attribute access (see :mod:`dsplug.api_paths`).

``__compatible_ops__`` (DeepSpeed's name): per DeepSpeed op name (``FusedAdamBuilder.NAME`` ...),
whether what that op provides runs here -- see :func:`compatible_ops`.
"""
from __future__ import annotations

from typing import Dict

from dsplug.api_paths import plugin_names

_plugin_getattr, __dir__ = plugin_names(__name__)

#: DeepSpeed ops whose feature dsplug provides without a native build of its own: the op name ->
#: the dsplug name that does the op's work on every device torch runs on.
TORCH_BACKED_OPS: Dict[str, str] = {
    "fused_adam": "dsplug.ops.adam.FusedAdam (torch's fused / foreach Adam kernels)",
}


def compatible_ops() -> Dict[str, bool]:
    """``{op name: usable here}`` for every op builder under ``dsplug.ops.op_builder``.

    A native op of dsplug's (``cpu_adam``, ``async_io`` ...) is usable everywhere: its builder's
    ``load()`` gives the native build where this machine can build it and the op's pure-torch
    fallback elsewhere (``is_compatible()`` says which; ``dsplug report`` shows it). A DeepSpeed op
    listed in :data:`TORCH_BACKED_OPS` is usable: its feature runs on torch's kernels (its builder
    still cannot ``load()`` DeepSpeed's extension). Every other DeepSpeed op is not available.
    """
    from dsplug.ops import op_builder

    result: Dict[str, bool] = {}
    for name in op_builder.__all__:
        builder = getattr(op_builder, name)
        op = getattr(builder, "NAME", None)
        if not isinstance(builder, type) or not op:
            continue
        if op in TORCH_BACKED_OPS:
            result[op] = True
        elif issubclass(builder, op_builder.UnavailableOpBuilder):
            result.setdefault(op, False)
        else:
            result[op] = True
    return result


def __getattr__(attr):
    if attr == "__compatible_ops__":
        value = compatible_ops()
        globals()[attr] = value
        return value
    return _plugin_getattr(attr)
