"""DeepSpeed's ZeRO wrapper optimizers -- ``deepspeed.runtime.zero.stage_1_and_2.
DeepSpeedZeroOptimizer`` and ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3`` -- as
names that say what dsplug does instead: the ZeRO stages are ``zero_stage`` plugins
(``engine.stage``), and ``engine.optimizer`` has a wrapper's shape without being one
(:class:`dsplug.optimizer_view.WrappedOptimizer`). Importable, usable in
``isinstance`` checks (always False for dsplug's engines); constructing one raises
:class:`dsplug.unavailable.NotAvailableInDsplug` explaining that. The memory estimators at the same
paths are real (:mod:`.memory_estimators`)."""
from dsplug.unavailable import unavailable_class

DeepSpeedZeroOptimizer = unavailable_class("DeepSpeedZeroOptimizer", "dsplug.runtime.zero.stage_1_and_2",
                                           "wrapper_optimizers")
DeepSpeedZeroOptimizer_Stage3 = unavailable_class("DeepSpeedZeroOptimizer_Stage3", "dsplug.runtime.zero.stage3",
                                                  "wrapper_optimizers")

__all__ = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]
