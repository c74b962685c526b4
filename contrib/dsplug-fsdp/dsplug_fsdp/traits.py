"""What the ``fsdp2`` stage declares it does, shared by its spec (:mod:`.plugin`) and its class
(:mod:`.stage`). Cheap to import.

Parameters, gradients and optimizer states are all sharded (each rank keeps rows of every
parameter, its gradient and its optimizer state), so ``engine.zero_optimization_stage()`` answers
3. ``deepspeed_stage`` stays None: ``dsplug.zero.GatheredParameters`` gathers this stage's
parameters (:meth:`.stage.Fsdp2Stage.gathered`), but callers that branch on DeepSpeed's stage 3
(Hugging Face transformers / accelerate) also read ``model.state_dict()``, which holds FSDP2's
DTensor shards; this stage does not claim to be DeepSpeed's stage 3. Nothing is offloaded: a
config that sets an offload device is refused by the ``zero_optimization`` rules.
"""
from __future__ import annotations

from dsplug.contracts import ZeroStageTraits

TRAITS = ZeroStageTraits(deepspeed_stage=None, partitions_optimizer_states=True, partitions_gradients=True,
                         partitions_parameters=True, offload_optimizer=None, offload_param=None, offload_ratio=False)
