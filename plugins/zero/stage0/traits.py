"""What this stage declares it does (:class:`dsplug.contracts.ZeroStageTraits`), shared by
its spec (:mod:`.plugin`) and its class (:mod:`.stage`). Cheap to import."""
from __future__ import annotations

from dsplug.contracts.zero_stage import ZeroStageTraits

#: stage 0 partitions nothing and offloads nothing; its reductions divide by the reduction's divisor
TRAITS = ZeroStageTraits(deepspeed_stage=0, gradient_sum=True)
