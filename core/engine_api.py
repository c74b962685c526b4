"""DeepSpeed's ``DeepSpeedEngine`` accessors, on top of the engine's parts.

A mixin of :class:`dsplug.engine.Engine`: the questions DeepSpeed scripts and Hugging Face ask
of the engine, and DeepSpeed's small engine methods around training (``set_gradient_accumulation_boundary``,
``compile``, ``_zero3_consolidated_16bit_state_dict`` ...). They answer from the config and the
contract objects; the precision's and stage's DeepSpeed names (``fp16_enabled`` ...) are
DeepSpeed's API, kept here and out of the conductor.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from .contracts.zero_stage import traits_of
from .optimizer_view import WrappedOptimizer, wraps_optimizer


class DeepSpeedAccessors:
    # ------------------------------------------------------------------ batch
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    # ------------------------------------------------------------------ optimizer
    def _optimizer_as_deepspeed_returns(self):
        """``engine.optimizer``: the base optimizer (``self.basic_optimizer``), or where DeepSpeed
        would wrap it (ZeRO stages 1-3, fp16 / bf16) a :class:`~dsplug.optimizer_view.WrappedOptimizer`
        whose ``.optimizer`` is the base."""
        base = self.basic_optimizer
        if base is None or not wraps_optimizer(self.zero_optimization_stage(), self.precision.name):
            return base
        return WrappedOptimizer(base, self.precision, self.stage)

    def allreduce_gradients(self, bucket_size=None) -> None:
        """DeepSpeed's explicit gradient reduction, which its ``backward()`` calls at an accumulation
        boundary. dsplug's stages reduce inside ``backward()``: at every micro-step where they
        partition gradients (stages 2-3), at the boundary otherwise; so where DeepSpeed would
        reduce, the gradients already are, and this returns. Reducing a stage 0-1 window's local
        gradients before its boundary is not built and raises."""
        if traits_of(self.stage).partitions_gradients or self.is_gradient_accumulation_boundary():
            return
        raise RuntimeError(
            f"engine.allreduce_gradients(): micro-step {self.micro_steps} is inside an accumulation window, "
            f"and ZeRO stage {self.zero_optimization_stage()} reduces gradients at the window's boundary "
            "(the backward() of its last micro-step); reducing them earlier is not built in dsplug")

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

    def _publish_step_result(self, applied: bool) -> None:
        """``engine.optimizer.overflow``: True when the last step was skipped (DeepSpeed's ZeRO and
        fp16 optimizers have it; Hugging Face Accelerate reads it as ``step_was_skipped``)."""
        if self.optimizer is not None:
            try:
                self.optimizer.overflow = not applied
            except AttributeError:  # an optimizer object that takes no new attributes
                pass

    # ------------------------------------------------------------------ gradient accumulation
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the coming micro-step ends an accumulation window, overriding the count of
        ``gradient_accumulation_steps`` from now on (DeepSpeed's semantics). At a boundary the
        backward pass reduces gradients over ranks and ``step()`` updates the weights; elsewhere
        gradients accumulate locally and ``step()`` only counts the micro-step. Hugging Face
        Accelerate calls this before every ``backward`` and calls ``step()`` only at boundaries."""
        self._boundary_flag = bool(is_boundary)

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
        """DeepSpeed's number of the stage (0-3), from its traits (:class:`dsplug.contracts.ZeroStageTraits`)."""
        return traits_of(self.stage).zero_optimization_stage()

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (DeepSpeed's accessor)."""
        zero = self.config.get("zero_optimization") or {}
        return bool(zero.get("stage3_gather_16bit_weights_on_model_save", False))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[Dict[str, Any]]:
        """The full module state dict in the training dtype, on the CPU, gathered from the
        partitions where the stage partitions them: a collective, so every rank must call it. Rank
        0 gets the dict, the other ranks None (as in DeepSpeed, whatever the flag of
        :meth:`zero_gather_16bit_weights_on_model_save`, which callers check themselves)."""
        state = self.stage.module_state_dict()  # every rank: a collective when partitioned
        if self.global_rank != 0:
            return None
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad} \
            if exclude_frozen_parameters else set()
        return {k: v.detach().cpu() for k, v in state.items() if k not in frozen}

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

    def sparse_gradients_enabled(self) -> bool:
        return bool(self.config.kernel.sparse_gradients)

    @property
    def sparse_tensor_module_names(self) -> set:
        """DeepSpeed's names of the embedding weights it all-reduces as sparse tensors under
        ``sparse_gradients: true`` (``<module>.weight`` of each ``nn.Embedding`` / ``EmbeddingBag``;
        empty otherwise). dsplug reduces them densely (the key is inert) and reports the same names."""
        import torch

        if not self.sparse_gradients_enabled():
            return set()
        return {f"{name}.weight" for name, m in self.module.named_modules()
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag, expp_rank: Optional[int] = None) -> str:
        """The file of ``checkpoints_path/<tag>`` that holds this rank's optimizer state, as
        DeepSpeed's engine names it for its loads (its tests spy on it). A stage that partitions the
        optimizer state saves each rank's part in the rank's ``zero_pp_rank_<r>_mp_rank_<m>`` file;
        otherwise the state is replicated and saved once, in the shared ``mp_rank_<m>_model_states``
        file (as DeepSpeed does at stage 0). dsplug keeps expert parameters' state in those files
        too, so ``expp_rank`` (DeepSpeed's index of a separate expert-parallel file) selects nothing."""
        import os

        from . import checkpoint as ckpt

        mp_rank = self.context.mp_rank
        partitioned = traits_of(self.stage).partitions_optimizer_states
        name = ckpt.optim_file(self.context.rank, mp_rank) if partitioned else ckpt.model_file(mp_rank)
        return os.path.join(checkpoints_path, str(tag), name)

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """DeepSpeed's private name (its checkpoint tests call it): make the recovery script ``dst``
        (``zero_to_fp32.py`` beside the checkpoints) executable; a file system that refuses is logged
        at info level and never fails a save (:func:`dsplug.checkpoint.make_executable`)."""
        from . import checkpoint as ckpt

        ckpt.make_executable(dst)

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

    # ------------------------------------------------------------------ torch.compile
    def compile(self, backend=None, compile_kwargs: Optional[Dict[str, Any]] = None, schedule=None) -> None:
        """Compile the wrapped module with ``torch.compile(backend=..., **compile_kwargs)``
        (DeepSpeed's signature; the default backend is the accelerator's
        ``get_compile_backend()``). Compilation happens at the next forward. ``schedule`` (DeepSpeed's
        compiler passes) is not available."""
        import torch

        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepSpeed's compile-pass schedules are not "
                                      "available in dsplug; call engine.compile(backend=..., compile_kwargs=...)")
        if not hasattr(torch, "compile"):
            raise RuntimeError(f"engine.compile needs torch.compile (torch >= 2.0); this is torch {torch.__version__}")
        if self.is_compiled:
            return
        backend = backend if backend is not None else self.accelerator.get_compile_backend()
        if isinstance(backend, str):
            known = torch._dynamo.list_backends(exclude_tags=())
            if backend not in known:
                raise ValueError(f"engine.compile: unknown torch.compile backend {backend!r} (available: "
                                 f"{', '.join(sorted(known))})")
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            raise ValueError("engine.compile: give the backend as backend=, not in compile_kwargs")
        self.module.compile(backend=backend, **kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return bool(getattr(self, "_is_compiled", False))

    # ------------------------------------------------------------------ data
    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        """A loader over ``dataset``: this rank's shard in micro-batches. Without ``data_sampler`` a
        plugin may choose the sampling of a training loader (``dsplug_dataloader_options``)."""
        from torch.utils.data import DataLoader

        from . import events
        from .dataloader import build_dataloader

        batch_size = batch_size or self.train_micro_batch_size_per_gpu()
        options = {}
        if data_sampler is None and route in (None, "train") and not isinstance(dataset, DataLoader):
            options = events.dataloader_options(self.events, self, dataset, batch_size)
        return build_dataloader(dataset, batch_size, self.world_size,  # the data-parallel place
                                self.context.rank, collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last,
                                sampler=data_sampler, num_workers=options.get("num_workers", num_local_io_workers or 0),
                                seed=self.config.seed or 0, batch_sampler=options.get("batch_sampler"),
                                pin_memory=options.get("pin_memory"))
