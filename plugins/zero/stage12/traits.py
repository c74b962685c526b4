"""What stages 1 and 2 declare they do (:class:`dsplug.contracts.ZeroStageTraits`), shared by
its spec (:mod:`.plugin`) and its class (:mod:`.stage`). Cheap to import."""
from __future__ import annotations

from dsplug.contracts.offload import BYTE_ADDRESSABLE
from dsplug.contracts.zero_stage import ZeroStageTraits

#: stage 1: optimizer states (and fp32 masters) partitioned; offloaded to byte-addressable storage
STAGE1_TRAITS = ZeroStageTraits(deepspeed_stage=1, partitions_optimizer_states=True,
                                offload_optimizer=frozenset({BYTE_ADDRESSABLE}))
#: stage 2: gradients partitioned too
STAGE2_TRAITS = ZeroStageTraits(deepspeed_stage=2, partitions_optimizer_states=True, partitions_gradients=True,
                                offload_optimizer=frozenset({BYTE_ADDRESSABLE}))
TRAITS = {1: STAGE1_TRAITS, 2: STAGE2_TRAITS}
