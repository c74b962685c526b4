"""What this stage declares it does (:class:`dsplug.contracts.ZeroStageTraits`), shared by
its spec (:mod:`.plugin`) and its class (:mod:`.stage`). Cheap to import."""
from __future__ import annotations

from dsplug.contracts.zero_stage import ZeroStageTraits

#: stage 3 partitions everything; it offloads optimizer state and parameters to any device (in
#: place when byte-addressable, through swap buffers otherwise) and splits the step (ratio < 1)
TRAITS = ZeroStageTraits(deepspeed_stage=3, partitions_optimizer_states=True, partitions_gradients=True,
                         partitions_parameters=True, offload_optimizer=frozenset(), offload_param=frozenset(),
                         offload_ratio=True)
