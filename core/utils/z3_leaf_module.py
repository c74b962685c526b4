"""DeepSpeed's ``deepspeed.utils.z3_leaf_module``: mark modules that ZeRO stage 3 gathers as one unit.

``set_z3_leaf_modules(model, [MoEBlock])`` marks every submodule of those classes (classes or
class names); under ZeRO stage 3 each marked module's whole subtree of parameters is gathered when
its forward starts and kept until it ends, instead of child by child (for modules whose children
run in data-dependent order, such as mixture-of-experts blocks). Mark before
``dsplug.initialize``. ``unset_z3_leaf_modules``, ``get_z3_leaf_modules(model)``,
``z3_leaf_module(module)`` and ``z3_leaf_parameter(param)`` inspect and undo the marks.

The names come from the installed plugin that declares this path through the
``dsplug_api_modules`` hook (dsplug's own: the ZeRO stage-3 plugin, which honours the marks);
they are resolved on first use (see :mod:`dsplug.public`).
"""
from dsplug.public import forward_to_plugin

__getattr__, __dir__ = forward_to_plugin(__name__)
