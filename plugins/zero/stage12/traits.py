"""What stages 1 and 2 declare they do (:class:`dsplug.contracts.ZeroStageTraits`), shared by
their spec (:mod:`.plugin`) and their class (:mod:`.stage`), and the config rule refusing what they
do not implement. Cheap to import."""
from __future__ import annotations

from dsplug.contracts.offload import BYTE_ADDRESSABLE
from dsplug.contracts.zero_stage import ZeroStageTraits

#: stage 1: optimizer states (and fp32 masters) partitioned; offloaded to byte-addressable storage
STAGE1_TRAITS = ZeroStageTraits(deepspeed_stage=1, partitions_optimizer_states=True,
                                offload_optimizer=frozenset({BYTE_ADDRESSABLE}), gradient_sum=True)
#: stage 2: gradients partitioned too
STAGE2_TRAITS = ZeroStageTraits(deepspeed_stage=2, partitions_optimizer_states=True, partitions_gradients=True,
                                offload_optimizer=frozenset({BYTE_ADDRESSABLE}), gradient_sum=True)
TRAITS = {1: STAGE1_TRAITS, 2: STAGE2_TRAITS}


def stage12_not_implemented(config, report) -> None:
    """Refuse, at config time, what stages 1/2 do not implement."""
    zero = config.sections.get("zero_optimization")
    if zero is None or str(zero.stage) not in ("1", "2"):
        return
    if zero.legacy_stage1:
        report.error("zero_optimization.legacy_stage1", "DeepSpeed's legacy stage 1 is not available in dsplug; "
                     "remove the key (stage 1 here is the current implementation)")
