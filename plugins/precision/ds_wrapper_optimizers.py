"""DeepSpeed's mixed-precision wrapper optimizers -- ``deepspeed.runtime.fp16.fused_optimizer.
FP16_Optimizer``, ``deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer``,
``deepspeed.runtime.bf16_optimizer.BF16_Optimizer`` -- as names that say what dsplug does instead.

fp16 / bf16 master weights and loss scaling are this plugin's precision policy
(``engine.precision``), and ``engine.optimizer`` has a wrapper's shape without being one
(:class:`dsplug.optimizer_view.WrappedOptimizer`). So these classes can be
imported and used in ``isinstance`` checks (always False for dsplug's engines), and constructing
one raises :class:`dsplug.unavailable.NotAvailableInDsplug` explaining that.
"""
from dsplug.unavailable import unavailable_class

FP16_Optimizer = unavailable_class("FP16_Optimizer", "dsplug.runtime.fp16.fused_optimizer", "wrapper_optimizers")
FP16_UnfusedOptimizer = unavailable_class("FP16_UnfusedOptimizer", "dsplug.runtime.fp16.unfused_optimizer",
                                          "wrapper_optimizers")
BF16_Optimizer = unavailable_class("BF16_Optimizer", "dsplug.runtime.bf16_optimizer", "wrapper_optimizers")
