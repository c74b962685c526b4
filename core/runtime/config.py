"""DeepSpeed's ``deepspeed.runtime.config``: :class:`DeepSpeedConfig` and the config-key constants.

``DeepSpeedConfig(config)`` (a path, a dict or JSON text) parses the config as the engine would,
with the batch sizes resolved against the current data-parallel world size, and answers
DeepSpeed's attribute names (``train_batch_size``, ``zero_optimization_stage``, ``fp16_enabled``
...), which is how integrations such as Hugging Face's read a config. ``"auto"`` values are
accepted and stay ``"auto"`` (the engine resolves them). The parsed
:class:`dsplug.config.DsplugConfig` is ``.config``; ``_param_dict`` is the resolved dict.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

from ..config import ConfigError, DsplugConfig
from .constants import *  # noqa: F401,F403 - DeepSpeed's runtime.config re-exports its constants

#: DeepSpeed's name for the error a bad config raises
DeepSpeedConfigError = ConfigError

def _dtype(name: Optional[str]):
    if name is None:
        return None
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


class DeepSpeedConfig:
    """A config's values under DeepSpeed's ``DeepSpeedConfig`` attribute names.

    ``config``: a path, dict or JSON text (or a parsed :class:`~dsplug.config.DsplugConfig`).
    ``mpu`` (model parallelism) must be None. ``world_size``: the data-parallel size the batch sizes
    are resolved against (default: the current process group's size, 1 before
    ``init_distributed``).
    """

    def __init__(self, config, mpu=None, mesh_device=None, world_size: Optional[int] = None):
        if mpu is not None:
            raise NotImplementedError("DeepSpeedConfig: model parallelism (mpu) is not available in dsplug")
        from .. import comm

        self.global_rank = comm.get_rank()
        self.world_size = int(world_size) if world_size is not None else comm.get_world_size()
        self.config = config if isinstance(config, DsplugConfig) else DsplugConfig(config, world_size=self.world_size)
        self._param_dict: Dict[str, Any] = self.config.to_dict()
        self._initialize_params(self._param_dict)

    # ------------------------------------------------------------------ derived values
    def _initialize_params(self, d: Dict[str, Any]) -> None:
        kernel = self.config.kernel
        self.train_batch_size = kernel.train_batch_size
        self.train_micro_batch_size_per_gpu = kernel.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = kernel.gradient_accumulation_steps
        self.steps_per_print = kernel.steps_per_print
        self.dump_state = kernel.dump_state
        self.disable_allgather = kernel.disable_allgather
        self.communication_data_type = _dtype(kernel.communication_data_type)
        self.fp32_allreduce = kernel.fp32_allreduce
        self.prescale_gradients = kernel.prescale_gradients
        self.gradient_predivide_factor = kernel.gradient_predivide_factor
        self.sparse_gradients_enabled = kernel.sparse_gradients
        self.gradient_clipping = kernel.gradient_clipping
        self.wall_clock_breakdown = kernel.wall_clock_breakdown
        self.memory_breakdown = kernel.memory_breakdown
        self.zero_allow_untested_optimizer = kernel.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = kernel.zero_force_ds_cpu_optimizer
        self.dataloader_drop_last = kernel.dataloader_drop_last
        self.seed = kernel.seed
        self.grad_accum_dtype = kernel.data_types.grad_accum_dtype
        checkpoint = kernel.checkpoint
        self.checkpoint_tag_validation_enabled = str(checkpoint.tag_validation).lower() != "ignore"
        self.checkpoint_tag_validation_fail = str(checkpoint.tag_validation).lower() == "fail"
        self.load_universal_checkpoint = checkpoint.load_universal
        self.use_node_local_storage = checkpoint.use_node_local_storage

        from ..contracts.zero_stage import selected_traits

        traits = selected_traits(self.config)  # the selected stage's DeepSpeed number (0-3)
        self.zero_optimization_stage = traits.zero_optimization_stage() if traits is not None else 0
        self.zero_enabled = self.zero_optimization_stage > 0

        fp16 = d.get(FP16) or {}  # noqa: F405
        bf16 = d.get(BFLOAT16) or {}  # noqa: F405
        amp = d.get(AMP) or {}  # noqa: F405
        self.fp16_enabled = fp16.get("enabled") is True
        self.fp16_auto_cast = bool(fp16.get("auto_cast", False)) if self.fp16_enabled else None
        self.fp16_master_weights_and_gradients = bool(fp16.get("fp16_master_weights_and_grads", False))
        self.bfloat16_enabled = bf16.get("enabled") is True
        self.bfloat16_immediate_grad_update = bool(bf16.get("immediate_grad_update", False))
        self.bfloat16_check_grad_overflow = bool(bf16.get("check_grad_overflow", False))
        self.amp_enabled = amp.get("enabled") is True
        self.amp_params = {k: v for k, v in amp.items() if k != "enabled"} if self.amp_enabled else False
        self.loss_scale = fp16.get("loss_scale", 0) if self.fp16_enabled else 0
        power = fp16.get("initial_scale_power", 16)
        self.initial_dynamic_scale = 2 ** power if isinstance(power, int) else None
        self.dynamic_loss_scale_args = {
            "init_scale": self.initial_dynamic_scale,
            "scale_window": fp16.get("loss_scale_window", 1000),
            "delayed_shift": fp16.get("hysteresis", 2),
            "consecutive_hysteresis": fp16.get("consecutive_hysteresis", False),
            "min_scale": fp16.get("min_loss_scale", 1),
        } if self.fp16_enabled and not self.loss_scale else None

        optimizer = d.get(OPTIMIZER)  # noqa: F405
        self.optimizer_name = optimizer["type"].lower() if optimizer else None
        self.optimizer_params = dict(optimizer.get("params", {})) if optimizer else None
        self.optimizer_legacy_fusion = False
        scheduler = d.get(SCHEDULER)  # noqa: F405
        self.scheduler_name = scheduler["type"] if scheduler else None
        self.scheduler_params = dict(scheduler.get("params", {})) if scheduler else None

        self.elasticity_enabled = (d.get("elasticity") or {}).get("enabled") is True
        self.pld_enabled = False
        self.pld_params = False
        self.curriculum_enabled_legacy = False
        self.curriculum_params_legacy = False
        self.data_efficiency_enabled = False
        self.eigenvalue_enabled = False
        self.sequence_parallel_size = 1
        self.compile_config = None

    # ------------------------------------------------------------------ DeepSpeed's other names
    @property
    def bf16_enabled(self) -> bool:
        return self.bfloat16_enabled

    @property
    def zero_config(self):
        """The ``zero_optimization`` section as DeepSpeed's ``DeepSpeedZeroConfig`` (from the ZeRO plugin)."""
        from .zero.config import DeepSpeedZeroConfig

        section = self.config.raw.get(ZERO_OPTIMIZATION) or {}  # noqa: F405 - as given: absent offloads are None
        return DeepSpeedZeroConfig({"stage": 1 if section else 0} if isinstance(section, bool) else dict(section))

    @property
    def flops_profiler_config(self):
        return self.config.section("flops_profiler")

    @property
    def monitor_config(self) -> Dict[str, Any]:
        return {k: self._param_dict[k] for k in ("tensorboard", "wandb", "csv_monitor", "comet")
                if k in self._param_dict}

    @property
    def checkpoint_config(self) -> Dict[str, Any]:
        return dict(self._param_dict.get(CHECKPOINT) or {})  # noqa: F405

    def print_user_config(self) -> None:
        print(json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        print(f"{name}:")
        for key in sorted(vars(self)):
            if key not in ("config", "_param_dict"):
                print(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        print("  json = " + json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self._param_dict!r})"


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
