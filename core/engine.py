"""The engine: builds the parts from the registry and conducts forward / backward / step.

Feature logic lives in plugins. The engine asks the registry for the plugin each config value
names (precision, ZeRO stage, optimizer, scheduler, monitors and observers), hands every factory
a :class:`~dsplug.context.BuildContext`, and calls them in order. The ZeRO stage object owns the
path from gradients to updated weights (reduction, master weights, unscaling, clipping, the
optimizer step).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

import pluggy
import torch

from . import checkpoint as ckpt
from . import comm
from .accelerator import get_accelerator
from .config import DsplugConfig
from .config.auto import model_hidden_size
from .context import BuildContext
from .hookspecs import PROJECT, LifecycleSpecs
from .logging import log_rank0
from .registry import get_registry
from .timers import StepTimers

PRECISION_SECTIONS = ("fp16", "bf16", "amp")
#: param-group key linking the engine's groups back to a client optimizer's own groups
CLIENT_GROUP_INDEX = "_dsplug_client_group"


class Engine(torch.nn.Module):
    """What ``dsplug.initialize`` returns; DeepSpeed's ``DeepSpeedEngine`` API."""

    def __init__(self, model: torch.nn.Module, config, optimizer=None, model_parameters=None,
                 training_data=None, lr_scheduler=None, collate_fn=None, dist_init_required=None,
                 registry=None, auto_values: Optional[Dict[str, Any]] = None):
        super().__init__()
        if model is None:
            raise ValueError("dsplug.initialize: model is required (a torch.nn.Module)")
        comm.init_distributed(dist_init_required=dist_init_required, verbose=False)
        self.registry = registry or get_registry()
        self.world_size = comm.get_world_size()
        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.config = config if isinstance(config, DsplugConfig) else DsplugConfig(
            config, world_size=self.world_size, registry=self.registry, auto_values=auto_values,
            hidden_size=model_hidden_size(model), strict_auto=True)
        kernel = self.config.kernel
        if kernel.seed is not None:
            torch.manual_seed(kernel.seed)
        self.accelerator = get_accelerator(self.registry)
        self.device = self.accelerator.device(self.local_rank if self.accelerator.name != "cpu" else None)
        self.context = BuildContext(config=self.config, accelerator=self.accelerator, comm=comm,
                                    rank=self.global_rank, world_size=self.world_size, local_rank=self.local_rank,
                                    model=model, registry=self.registry)
        self.precision = self._build_precision()
        self.events = self._build_observers()  # before any collective, so loggers see them all
        self.module = model
        self._place_model()
        param_groups = _param_groups(model, model_parameters, optimizer)
        self.zero_config = self.config.section("zero_optimization")
        stage_number = self.zero_config.stage if self.zero_config is not None else 0
        stage_plugin = self.registry.get("zero_stage", str(stage_number), what="zero_optimization.stage")
        _refuse_partitioned_params(model, stage_number)
        previous = getattr(model, "_dsplug_stage", None)
        if previous is not None:  # initialize() again on the same model: retire the old engine's hooks
            log_rank0("warning: this model was already wrapped by a dsplug engine; that engine's hooks are "
                      "removed and it must not be used any more", logging.WARNING)
            previous.close()
        self.stage = stage_plugin.spec.factory(model, param_groups, self._optimizer_builder(optimizer),
                                               self.precision, self.zero_config, self.context)
        object.__setattr__(model, "_dsplug_stage", self.stage)
        self.optimizer = self.stage.optimizer
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) \
            if training_data is not None else None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._losses: List[torch.Tensor] = []
        self.timers = StepTimers(self.accelerator, enabled=kernel.wall_clock_breakdown)
        self.events.hook.dsplug_engine_built(engine=self)
        if kernel.dump_state:
            self.dump_state()

    # ------------------------------------------------------------------ construction
    def _build_precision(self):
        enabled = [s for s in PRECISION_SECTIONS if getattr(self.config.sections.get(s), "enabled", False) is True]
        name = enabled[0] if enabled else "fp32"
        provided = self.registry.get("precision", name, what=f"{name}.enabled" if enabled else "precision")
        section = self.config.section(provided.spec.section) if provided.spec.section else None
        return provided.spec.factory(section, self.context)

    def _place_model(self) -> None:
        self.module.to(self.device)
        if self.precision.model_dtype != torch.float32:
            self.module.to(self.precision.model_dtype)
        if self.world_size > 1:
            with torch.no_grad():
                for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                    comm.broadcast(tensor.data, src=0)

    def _optimizer_builder(self, client_optimizer):
        selected = self.config.optimizer
        context = self.context
        if client_optimizer is not None and selected is not None:
            raise ValueError("dsplug.initialize: an optimizer was passed and the config has an 'optimizer' section; "
                             "use one of them")
        if isinstance(client_optimizer, torch.optim.Optimizer):
            def rebind(groups):
                if client_optimizer.state and self.precision.master_weights:
                    raise ValueError("the client optimizer already has state; with fp16/bf16 master weights "
                                     "pass a fresh optimizer (or a callable that builds one)")
                for own in client_optimizer.param_groups:
                    own["params"] = []  # a group with only frozen parameters stays empty
                for new in groups:
                    client_optimizer.param_groups[new[CLIENT_GROUP_INDEX]]["params"] = list(new["params"])
                return client_optimizer
            return rebind
        if callable(client_optimizer):
            return lambda groups: client_optimizer(groups)
        if selected is not None:
            return lambda groups: selected.build(groups, selected.params, context)
        return lambda groups: None

    def _build_scheduler(self, client_scheduler):
        selected = self.config.scheduler
        if client_scheduler is not None and selected is not None:
            raise ValueError("dsplug.initialize: an lr_scheduler was passed and the config has a 'scheduler' section; "
                             "use one of them")
        if client_scheduler is not None:
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                return client_scheduler(self.optimizer)
            return client_scheduler
        if selected is not None:
            if self.optimizer is None:
                raise ValueError("the config has a 'scheduler' section but no optimizer was given")
            return selected.build(self.optimizer, selected.params, self.context)
        return None

    def _build_observers(self) -> pluggy.PluginManager:
        bus = pluggy.PluginManager(PROJECT)
        bus.add_hookspecs(LifecycleSpecs)
        self.observers = []
        for provided in self.registry.all():
            section = provided.spec.section
            if provided.category not in ("monitor", "observer") or section not in self.config.sections:
                continue
            observer = provided.spec.factory(self.config.sections[section], self.context)
            if observer is not None:
                bus.register(observer, name=f"{provided.category}:{provided.name}")
                self.observers.append(observer)
        for plugin in self.registry.lifecycle_plugins():
            if not bus.is_registered(plugin):
                bus.register(plugin)
        return bus

    # ------------------------------------------------------------------ training
    def forward(self, *inputs, **kwargs):
        self.events.hook.dsplug_forward_begin(engine=self)
        self.timers.start("forward")
        with self.precision.autocast():
            output = self.module(*inputs, **kwargs)
        self.timers.stop("forward")
        self.events.hook.dsplug_forward_end(engine=self, output=output)
        return output

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True, release_loss: bool = False,
                 retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of one micro-step; the loss is divided by the accumulation steps."""
        if self.optimizer is None:
            raise RuntimeError("engine.backward: no optimizer (give an 'optimizer' config section or pass optimizer=)")
        self.timers.start("backward")
        self._losses.append(loss.detach())
        gas = self.gradient_accumulation_steps()
        scaled = loss / gas if (scale_wrt_gas and gas > 1) else loss
        if self.precision.loss_scale != 1.0:
            scaled = scaled.float() * self.precision.loss_scale
        self.stage.before_backward(self.is_gradient_accumulation_boundary() and allreduce_gradients)
        scaled.backward(retain_graph=retain_graph)
        self.stage.after_backward()
        self.timers.stop("backward")
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def step(self, lr_kwargs=None):
        """Call after every micro-step's backward; updates weights at accumulation boundaries."""
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            self.timers.start("step")
            applied = self.stage.step()
            self._step_applied = applied
            if applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                if self.precision.loss_scaler is not None:
                    log_rank0(f"overflow: step {self.global_steps + 1} skipped, loss scale lowered to "
                              f"{self.precision.loss_scale:g}", logging.INFO)
                else:
                    log_rank0(f"non-finite gradients: step {self.global_steps + 1} skipped", logging.INFO)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.timers.stop("step")
            self._end_of_step()
        self.micro_steps += 1

    def _end_of_step(self) -> None:
        loss = float(torch.stack([l.float() for l in self._losses]).mean()) if self._losses else float("nan")
        self._losses = []
        metrics = {"loss": loss, "lr": self.get_lr()[0] if self.optimizer is not None else 0.0,
                   "global_samples": float(self.global_samples), "global_steps": float(self.global_steps),
                   "skipped": 0.0 if self._step_applied else 1.0}
        if self.precision.loss_scaler is not None:
            metrics["loss_scale"] = float(self.precision.loss_scale)
        times = self.timers.collect()
        metrics.update({f"{k}_ms": v for k, v in times.items()})
        self.events.hook.dsplug_step_end(engine=self, metrics=metrics)
        if self.global_steps % self.config.steps_per_print == 0:
            self._print_progress(metrics)

    def _print_progress(self, metrics) -> None:
        parts = [f"step={self.global_steps}", f"skipped={self.skipped_steps}", f"lr={self.get_lr()}",
                 f"mom={self.get_mom()}", f"loss={metrics['loss']:.6g}"]
        if "loss_scale" in metrics:
            parts.append(f"loss_scale={metrics['loss_scale']:g}")
        if self.timers.enabled:
            parts += [f"{k}={metrics[k]:.2f}" for k in ("forward_ms", "backward_ms", "step_ms") if k in metrics]
        if self.config.memory_breakdown:
            parts.append(f"mem_allocated={self.accelerator.memory_allocated() / 2**20:.1f}MiB")
        log_rank0("[dsplug] " + ", ".join(parts))

    def zero_grad(self) -> None:
        self.stage.zero_grad()

    # ------------------------------------------------------------------ queries
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> List[Any]:
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self.stage.last_grad_norm

    def get_loss_scale(self) -> float:
        return self.precision.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.precision.loss_scale

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_optimization_stage(self) -> int:
        return self.stage.stage

    def zero_optimization(self) -> bool:
        return self.stage.stage > 0

    def fp16_enabled(self) -> bool:
        return self.precision.name == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision.name == "bf16"

    def amp_enabled(self) -> bool:
        return self.precision.name == "amp"

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def model_state_memory(self) -> Dict[str, int]:
        """Bytes this rank's engine holds now: ``parameters``, ``gradients``, ``optimizer_states``
        (incl. fp32 master weights), their ``total``, and communication ``buffers`` (bucket buffers).

        Compare with ``dsplug.plugins.zero.memory.model_state_bytes``. (DeepSpeed's
        ``memory_breakdown()`` is the config flag, so this has its own name.)
        """
        report = getattr(self.stage, "memory_breakdown", None)
        if report is None:
            raise NotImplementedError(f"ZeRO stage {self.stage.stage} ({type(self.stage).__name__}) does not "
                                      "report its memory (it has no memory_breakdown())")
        return report()

    def dump_state(self) -> None:
        import json

        if self.global_rank != 0:
            return
        print("[dsplug] engine state:")
        print(json.dumps(self.config.to_dict(), indent=2, default=str))
        print(f"  world_size={self.world_size} device={self.device} precision={self.precision.name} "
              f"zero_stage={self.stage.stage} optimizer={type(self.optimizer).__name__} "
              f"scheduler={type(self.lr_scheduler).__name__ if self.lr_scheduler else None} "
              f"observers={[type(o).__name__ for o in self.observers]}")

    # ------------------------------------------------------------------ data
    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        from .dataloader import build_dataloader

        return build_dataloader(dataset, batch_size or self.train_micro_batch_size_per_gpu(), self.world_size,
                                self.global_rank, collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last,
                                sampler=data_sampler, num_workers=num_local_io_workers or 0,
                                seed=self.config.seed or 0)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Save to ``save_dir/tag`` (default ``global_step<N>``), crash-safe: the staged tag replaces
        the old one and ``latest`` moves only after every rank wrote its files. A failure on any
        rank raises on every rank (none is left waiting) and leaves the previous checkpoint as is."""
        save_dir = os.fspath(save_dir)
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        ckpt.check_tag(tag)
        self._validate_tag(tag)
        rank0 = self.global_rank == 0
        self._on_every_rank("preparing", lambda: ckpt.begin(save_dir, tag) if rank0 else None)
        staging = ckpt.partial_dir(save_dir, tag)
        module_state = self.stage.module_state_dict()  # collective at stage 3: every rank calls it

        def write_files():
            if rank0:
                state = module_state
                if exclude_frozen_parameters:
                    frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
                    state = {k: v for k, v in state.items() if k not in frozen}
                ckpt.atomic_save({
                    "module": state,
                    "global_steps": self.global_steps, "global_samples": self.global_samples,
                    "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                    "client_state": dict(client_state or {}), "observers": self._observer_states(),
                    "world_size": self.world_size, "zero_stage": self.stage.stage, "precision": self.precision.name,
                    "ds_config": self.config.to_dict(), "dsplug_version": _version(),
                }, os.path.join(staging, ckpt.MODEL_FILE))
            ckpt.atomic_save({"stage": self.stage.state_dict(), "precision": self.precision.state_dict(),
                              "rank": self.global_rank, "world_size": self.world_size},
                             os.path.join(staging, ckpt.optim_file(self.global_rank)))
            ckpt.atomic_save(ckpt.rng_state(self.accelerator), os.path.join(staging, ckpt.rng_file(self.global_rank)))

        self._on_every_rank("writing", write_files)
        self._on_every_rank("committing", lambda: ckpt.commit(save_dir, tag, save_latest) if rank0 else None)
        return True

    def _on_every_rank(self, what: str, step) -> None:
        """Run ``step`` here, then agree with every rank on whether it worked (a collective)."""
        error = None
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
        failures = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(rank, text) for rank, text in enumerate(failures) if text]
        if failed:
            rank, text = failed[0]
            raise ckpt.CheckpointError(f"checkpoint {what} failed on rank {rank}: {text}; the previous "
                                       "checkpoint is untouched")

    def _observer_states(self) -> Dict[str, Any]:
        """Extra state from observers, keyed by the observer's name so it finds its way back."""
        states = {}
        for impl in self.events.hook.dsplug_checkpoint_state.get_hookimpls():
            state = impl.function(engine=self)
            if state:
                states[impl.plugin_name] = state
        return states

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the full module weights in the training dtype to ``save_dir/save_filename`` (rank 0).

        At ZeRO stage 3 the partitions are gathered first, which needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save``; without it nothing is
        saved and False is returned, as in DeepSpeed.
        """
        if self.stage.stage == 3 and not self.zero_config.stage3_gather_16bit_weights_on_model_save:
            log_rank0("warning: save_16bit_model at ZeRO stage 3 needs zero_optimization."
                      "stage3_gather_16bit_weights_on_model_save=true; nothing saved", logging.WARNING)
            return False
        state = self.stage.module_state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            ckpt.atomic_save(state, os.path.join(os.fspath(save_dir), save_filename))
        comm.barrier()
        return True

    def _validate_tag(self, tag: str) -> None:
        mode = self.config.checkpoint.tag_validation
        if mode == "Ignore" or self.world_size == 1:
            return
        tags = comm.all_gather_object(tag)
        if len(set(tags)) > 1:
            message = f"checkpoint tags differ across ranks: {tags}"
            if mode == "Fail":
                raise ckpt.CheckpointError(message + " (checkpoint.tag_validation is Fail)")
            log_rank0("warning: " + message, logging.WARNING)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        load_dir = os.fspath(load_dir)
        if tag is None:
            tag = ckpt.read_latest(load_dir)
            if tag is None:
                log_rank0(f"warning: no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a "
                          "specific checkpoint)", logging.WARNING)
                return None, None
        path = os.path.join(load_dir, str(tag))
        if not os.path.isdir(path) and os.path.isdir(path + ".old"):
            # a save of the same tag died between swapping directories: the old copy is complete
            log_rank0(f"warning: {path} is missing but {path}.old is complete; loading that", logging.WARNING)
            path = path + ".old"
        if not os.path.isdir(path):
            tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))) \
                if os.path.isdir(load_dir) else []
            raise ckpt.CheckpointError(f"checkpoint {path} does not exist" +
                                       (f"; tags in {load_dir}: {', '.join(tags)}" if tags else ""))
        weights_only = self.config.checkpoint.weights_only
        model_state = ckpt.load_file(os.path.join(path, ckpt.MODEL_FILE), weights_only)
        if custom_load_fn is not None:
            custom_load_fn(src=model_state["module"], dst=self.module)
        else:
            self.stage.load_module_state_dict(model_state["module"], strict=load_module_strict)
        if load_module_only:
            self.stage.refresh_master_from_model()
            return path, model_state.get("client_state", {})
        saved_world = int(model_state.get("world_size", 1))

        def read_rank(rank: int) -> dict:
            return ckpt.load_file(os.path.join(path, ckpt.optim_file(rank)), weights_only)

        optim_state = read_rank(min(self.global_rank, saved_world - 1))
        # a partitioned stage saved at another world size re-slices from every rank's file
        self.stage.load_state_dict(optim_state["stage"], load_optimizer_states=load_optimizer_states,
                                   saved_world_size=saved_world, read_rank=lambda r: read_rank(r)["stage"])
        self.precision.load_state_dict(optim_state["precision"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and model_state.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(model_state["lr_scheduler"])
        self.global_steps = model_state["global_steps"]
        self.global_samples = model_state["global_samples"]
        self.micro_steps = model_state["micro_steps"]
        self.skipped_steps = model_state["skipped_steps"]
        saved = model_state.get("observers") or {}
        for impl in self.events.hook.dsplug_load_checkpoint_state.get_hookimpls():
            if isinstance(saved, dict) and impl.plugin_name in saved:
                impl.function(engine=self, state=saved[impl.plugin_name])
        rng_path = os.path.join(path, ckpt.rng_file(self.global_rank))
        if os.path.exists(rng_path):
            ckpt.set_rng_state(ckpt.load_file(rng_path, weights_only), self.accelerator)
        return path, model_state.get("client_state", {})

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Close monitors' files and remove hooks; the engine is unusable afterwards."""
        self.events.hook.dsplug_engine_closed(engine=self)
        self.stage.close()
        if getattr(self.module, "_dsplug_stage", None) is self.stage:
            del self.module._dsplug_stage


def _refuse_partitioned_params(model, stage: int) -> None:
    from .zero import is_zero_param

    if stage != 3 and any(is_zero_param(p) for p in model.parameters()):
        raise ValueError(f"the model was built under dsplug.zero.Init, so its parameters are partitioned, but "
                         f"zero_optimization.stage is {stage}; use stage 3 (or build the model without zero.Init)")


def _param_groups(model, model_parameters, client_optimizer) -> List[dict]:
    if isinstance(client_optimizer, torch.optim.Optimizer):
        # remember each group's place: groups left without trainable parameters are dropped below
        groups = [{**g, CLIENT_GROUP_INDEX: i} for i, g in enumerate(client_optimizer.param_groups)]
    else:
        source = list(model_parameters) if model_parameters is not None else list(model.parameters())
        if source and isinstance(source[0], dict):
            groups = [dict(g) for g in source]
        else:
            groups = [{"params": source}]
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


def _version() -> str:
    from . import __version__

    return __version__
