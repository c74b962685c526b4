"""DeepSpeed's ``DeepSpeedEngine`` accessors, on top of the engine's parts.

A mixin of :class:`dsplug.engine.Engine`: read-only questions DeepSpeed scripts and Hugging Face
ask of the engine. They answer from the config and the contract objects; the precision's and
stage's DeepSpeed names (``fp16_enabled`` ...) are DeepSpeed's API, kept here and out of the
conductor.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


class DeepSpeedAccessors:
    # ------------------------------------------------------------------ batch
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    # ------------------------------------------------------------------ optimizer
    def get_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> List[Any]:
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self.stage.last_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ------------------------------------------------------------------ precision
    def get_loss_scale(self) -> float:
        return self.precision.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.precision.loss_scale

    def fp16_enabled(self) -> bool:
        return self.precision.name == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision.name == "bf16"

    def amp_enabled(self) -> bool:
        return self.precision.name == "amp"

    # ------------------------------------------------------------------ ZeRO
    def zero_optimization_stage(self) -> int:
        return self.stage.stage

    def zero_optimization(self) -> bool:
        return self.stage.stage > 0

    def model_state_memory(self) -> Dict[str, int]:
        """Bytes this rank's engine holds now: ``parameters``, ``gradients``, ``optimizer_states``
        (incl. fp32 master weights), their ``total``, and communication ``buffers``.
        (DeepSpeed's ``memory_breakdown()`` is the config flag, so this has its own name.)"""
        return self.stage.memory_breakdown()

    # ------------------------------------------------------------------ config flags
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def dump_state(self) -> None:
        if self.global_rank != 0:
            return
        print("[dsplug] engine state:")
        print(json.dumps(self.config.to_dict(), indent=2, default=str))
        print(f"  world_size={self.world_size} device={self.device} precision={self.precision.name} "
              f"zero_stage={self.stage.stage} optimizer={type(self.optimizer).__name__} "
              f"scheduler={type(self.lr_scheduler).__name__ if self.lr_scheduler else None} "
              f"observers={[type(o).__name__ for o in self.observers]} "
              f"compression={[m.name for m in self.compression]}")

    # ------------------------------------------------------------------ data
    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        from .dataloader import build_dataloader

        return build_dataloader(dataset, batch_size or self.train_micro_batch_size_per_gpu(), self.world_size,
                                self.global_rank, collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last,
                                sampler=data_sampler, num_workers=num_local_io_workers or 0,
                                seed=self.config.seed or 0)
