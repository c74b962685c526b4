"""The top-level keys the kernel itself owns (every other section belongs to a plugin)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .schema import INT_MAX, field, schema

DTYPE_NAMES = ("fp32", "fp16", "bf16")

#: ``steps_per_print: Infinity`` (what accelerate writes) is stored as this: a step count no run
#: reaches, so ``global_steps % steps_per_print`` is never 0 and nothing is printed.
NEVER = INT_MAX
#: bounds of the batch-size keys (see KernelConfig)
MAX_BATCH = 2 ** 40
MAX_MICRO = 2 ** 24


@schema
class ParallelWriteConfig:
    pipeline_stage: bool = field(False, doc="each pipeline stage writes its own model states", inert='pipeline parallelism is not available yet')


@schema
class CheckpointConfig:
    tag_validation: str = field(
        "Warn", choices=("Ignore", "Warn", "Fail"), case_insensitive=True,
        doc="check that every rank saves with the same tag",
    )
    load_universal: bool = field(False, doc="load a universal (reshardable) checkpoint", inert='dsplug checkpoints reload at any world size without conversion')
    use_node_local_storage: bool = field(False, doc="each node saves to its own local storage", inert='checkpoints are written to one shared directory')
    parallel_write: ParallelWriteConfig = field(factory=ParallelWriteConfig)
    weights_only: bool = field(True, doc="dsplug: torch.load(weights_only=True) when loading")
    keep_last: Optional[int] = field(None, ge=1, le=1_000_000, doc="dsplug: keep N complete checkpoints in the save "
                                     "directory (after a save completes; never the one 'latest' names or the one "
                                     "this run loaded; a branch a rollback abandoned goes first)")
    require_manifest: bool = field(True, doc="dsplug: refuse a checkpoint dsplug wrote whose manifest.json is missing "
                                   "(false: load it unverified, e.g. after deleting the manifest on purpose)")


@schema
class DataTypesConfig:
    grad_accum_dtype: Optional[str] = field(
        None, choices=DTYPE_NAMES, case_insensitive=True,
        doc="dtype gradients are accumulated in (default: the training dtype)",
    )


@schema
class SelectorConfig:
    """``optimizer`` / ``scheduler``: a ``type`` naming a plugin and its ``params``."""

    type: str = field(doc="name of the plugin to use")
    params: Dict[str, Any] = field(factory=dict, finite=False,  # checked by the plugin's own schema
                                   doc="arguments of the selected plugin")


@schema
class KernelConfig:
    # Upper bounds: far beyond any real run, and small enough that micro batch × accumulation × world
    # size (how the missing member is inferred) stays a 64-bit integer for any world size below 2**15.
    train_batch_size: Optional[int] = field(None, ge=1, le=MAX_BATCH, auto=True,
                                            doc="samples per optimizer step, all ranks (<= 2**40)")
    train_micro_batch_size_per_gpu: Optional[int] = field(None, ge=1, le=MAX_MICRO, auto=True,
                                                          doc="samples per rank per forward (<= 2**24)")
    gradient_accumulation_steps: Optional[int] = field(None, ge=1, le=MAX_MICRO, auto=True,
                                                       doc="micro-steps per optimizer step (<= 2**24)")
    gradient_clipping: float = field(0.0, ge=0, auto=True, doc="clip the global gradient norm to this (0 = off)")
    steps_per_print: int = field(10, ge=1, infinity=NEVER,
                                 doc="log progress every this many optimizer steps (Infinity: never, "
                                     "as Hugging Face accelerate writes it; stored as 2**63 - 1)")
    wall_clock_breakdown: bool = field(False, doc="time forward / backward / step")
    dump_state: bool = field(False, doc="print the engine's state after initialisation")
    memory_breakdown: bool = field(False, doc="log accelerator memory with the progress lines")
    prescale_gradients: bool = field(False, doc="divide gradients before the all-reduce instead of after")
    gradient_predivide_factor: float = field(
        1.0, ge=1e-6, le=1e6,
        doc="divide gradients by this before the all-reduce (and multiply by it / world size after); "
            "1e-6..1e6: beyond, the division or the multiplication back under- / overflows fp32 and fp16 "
            "gradients into 0 * inf = NaN (DeepSpeed users set 1 or the world size)")
    gradient_allreduce_op: str = field(
        "mean", choices=("mean", "sum"), case_insensitive=True,
        doc="how data-parallel gradients combine: 'mean' averages them over the ranks (a single process on "
            "the whole batch), 'sum' adds them (no division by the data-parallel size; ZeRO stages that "
            "declare gradient_sum: 0, 1 and 2)")
    communication_data_type: Optional[str] = field(
        None, choices=DTYPE_NAMES, case_insensitive=True, doc="dtype of gradient all-reduce (default: training dtype)"
    )
    fp32_allreduce: bool = field(False, doc="all-reduce gradients in fp32")
    sparse_gradients: bool = field(False, doc="sparse all-reduce for nn.Embedding gradients", inert='embedding gradients are reduced densely')
    disable_allgather: bool = field(False, doc="ZeRO: broadcast instead of all-gather")
    zero_allow_untested_optimizer: bool = field(False, doc="allow optimizers not tested with ZeRO")
    zero_force_ds_cpu_optimizer: bool = field(True, doc="require the native CPU optimizer with ZeRO-Offload")
    dataloader_drop_last: bool = field(False, doc="drop the last incomplete batch of training_data")
    seed: Optional[int] = field(None, doc="dsplug: seed torch's generators at initialize")
    comm_timeout_s: Optional[float] = field(
        None, gt=0, le=1_000_000,
        doc="dsplug: seconds a collective may wait for the other ranks; a dead or stopped rank then makes every "
            "survivor fail with an error naming it (default: the DSPLUG_COMM_TIMEOUT environment variable, "
            "else 1800). Must exceed the longest time one rank works while others wait (e.g. rank 0 writing "
            "a checkpoint file)")
    checkpoint: CheckpointConfig = field(factory=CheckpointConfig)
    data_types: DataTypesConfig = field(factory=DataTypesConfig)
    optimizer: Optional[SelectorConfig] = field(None, doc="optimizer.type selects an optimizer plugin")
    scheduler: Optional[SelectorConfig] = field(None, doc="scheduler.type selects a scheduler plugin")


#: sections documented by DeepSpeed that the kernel does not own; each needs a plugin.
DOCUMENTED_SECTIONS = {
    "fp16": "fp16 mixed precision",
    "bf16": "bf16 mixed precision",
    "amp": "NVIDIA-Apex-style automatic mixed precision",
    "zero_optimization": "ZeRO redundancy optimizer",
    "aio": "asynchronous NVMe I/O",
    "autotuning": "autotuning",
    "flops_profiler": "flops profiler",
    "activation_checkpointing": "activation checkpointing",
    "sparse_attention": "sparse attention",
    "data_efficiency": "data efficiency (sampling and routing)",
    "curriculum_learning": "curriculum learning",
    "tensorboard": "TensorBoard monitor",
    "wandb": "Weights & Biases monitor",
    "comet": "Comet monitor",
    "csv_monitor": "CSV monitor",
    "elasticity": "elastic training",
    "comms_logger": "communication logger",
    "pipeline": "pipeline parallelism",
    "progressive_layer_drop": "progressive layer dropping",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "MoQ quantize training",
    "nebula": "Nebula checkpointing service",
    "hybrid_engine": "hybrid (RLHF) engine",
    "weight_quantization": "weight quantization",
    "tensor_parallel": "automatic tensor parallelism",
    "monitor_config": "monitor configuration",
}

#: the section whose keys each select a compression plugin (the kernel owns the container)
COMPRESSION_SECTION = "compression_training"

#: compression methods DeepSpeed documents under ``compression_training``
DOCUMENTED_COMPRESSION_METHODS = {
    "weight_quantization": "weight quantization",
    "activation_quantization": "activation quantization",
    "sparse_pruning": "sparse pruning",
    "row_pruning": "row pruning",
    "head_pruning": "head pruning",
    "channel_pruning": "channel pruning",
    "layer_reduction": "layer reduction",
}
