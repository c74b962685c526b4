"""ZeRO stages 1 and 2 as ``zero_stage`` plugins (hooks only; the implementation is :mod:`.stage`).

What the ``zero_optimization`` keys do here:

* ``reduce_bucket_size``: gradients are averaged in buckets of at most this many elements
  (a larger parameter is a bucket of its own).
* ``reduce_scatter`` (default true): each bucket's pieces are *reduced* to the ranks that own them;
  false: the whole bucket is all-reduced and each rank keeps its own pieces.
* ``overlap_comm``: bucket reductions run asynchronously while backward continues (two buckets in
  flight); otherwise each blocks backward until done.
* ``contiguous_gradients`` (default true): gradients are copied into a preallocated bucket buffer
  as they are produced and released at once; false: they stay as separate tensors until their
  bucket is complete and are then flattened into a new buffer.
* ``grad_hooks`` (stage 1; default true): reduce from the gradient hooks during the last
  micro-step's backward; false: after that backward pass. Stage 2 always reduces from the hooks.
* ``round_robin_gradients``: flatten each group's parameters in round-robin order so consecutive
  layers belong to different ranks and each backward pass's reductions go to every rank in turn
  (DeepSpeed's use, spreading gradient copies to the CPU with ZeRO-Offload, does not arise: dsplug's
  offload copies each group's reduced partition to the host at the step). Results are unchanged.
* ``allgather_partitions`` / top-level ``disable_allgather``: updated partitions are all-gathered
  ``allgather_bucket_size`` elements at a time, or (allgather_partitions=false or
  disable_allgather=true) broadcast from their owners in pieces of the same size.
* ``load_from_fp32_weights`` (default true): on load, the fp32 master weights come from the
  checkpoint's fp32 partitions; false: from the module's (16-bit) weights.
* ``ignore_unused_parameters`` (default true): a parameter without a gradient counts as zeros;
  false: it is an error naming the parameters.
* ``elastic_checkpoint``: checkpoints are always loadable at another world size here.
* ``offload_optimizer.device``: the fp32 master partitions and the optimizer state live in the device's
  storage and the CPU optimizer steps them in place (:mod:`.offload`). The device must be
  byte-addressable (``cpu``, or a plugin's such as ``mmap``); ``nvme`` and ``ratio`` < 1 are stage-3
  features, refused by the ``zero_optimization`` rules from these stages' traits.
* ``legacy_stage1`` is refused (not implemented).

The optimizer must be element-wise (see :mod:`dsplug.plugins.zero.partitioning.checks`).
"""
from __future__ import annotations

from dsplug import PluginSpec, hookimpl

from .traits import STAGE1_TRAITS, STAGE2_TRAITS, stage12_not_implemented


def _build(stage: int):
    def factory(module, param_groups, build_optimizer, precision, zero_config, context):
        from ..partitioning.checks import refuse_partitioned_params
        from .stage import PartitionedStage

        refuse_partitioned_params(module, stage)
        return PartitionedStage(stage, module, param_groups, build_optimizer, precision, zero_config,
                                context.config.kernel, context)

    factory.__name__ = f"build_stage{stage}"
    return factory


@hookimpl
def dsplug_zero_stages():
    return [
        PluginSpec(category="zero_stage", name="1", factory=_build(1), rules=(stage12_not_implemented,),
                   traits=STAGE1_TRAITS,
                   summary="partitions optimizer states and fp32 master weights across data-parallel ranks"),
        PluginSpec(category="zero_stage", name="2", factory=_build(2), traits=STAGE2_TRAITS,
                   summary="stage 1 + gradients reduced into their owner's partition during backward"),
    ]
