"""The engine: builds the parts from the registry and conducts forward / backward / step.

The engine knows categories, never features. It asks the config which plugin of each category
to build (:meth:`~dsplug.config.DsplugConfig.selection`), hands every factory a
:class:`~dsplug.context.BuildContext`, and drives the objects through their contracts
(:mod:`dsplug.contracts`): the precision scales losses and wraps forward, the ZeRO stage owns the
path from gradients to updated weights, compression methods transform the model, observers and
monitors watch through the lifecycle hooks. Checkpoints gather and restore every part's state
through the checkpoint hooks (:mod:`dsplug.engine_checkpoint`). DeepSpeed's accessors live in
:mod:`dsplug.engine_api`.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import pluggy
import torch

from . import comm, engine_clients as clients, events, lazy_dynamo
from .accelerator import get_accelerator
from .config import DsplugConfig
from .config.auto import model_hidden_size
from .context import BuildContext
from .contracts.zero_stage import attach_stage, detach_stage, stage_of
from .engine_api import DeepSpeedAccessors
from .engine_clients import SchedulerBindingError  # noqa: F401 - dsplug.engine.SchedulerBindingError
from .engine_checkpoint import EngineCounters, SchedulerState, load_checkpoint, save_checkpoint
from .logging import log_rank0, step_logger
from .registry import get_registry
from .timers import StepTimers
from .comm import groups

lazy_dynamo.install()  # a run's first optimizer no longer imports torch._dynamo (2 s)

#: param-group key linking the engine's groups back to a client optimizer's own groups
class ModelRequiredError(ValueError, AssertionError):
    """``initialize`` without a model. Also an ``AssertionError``: DeepSpeed asserts the model is
    given, and code written against it catches that."""


class Engine(DeepSpeedAccessors, torch.nn.Module):
    """What ``dsplug.initialize`` returns; DeepSpeed's ``DeepSpeedEngine`` API."""

    def __init__(self, model: torch.nn.Module, config, optimizer=None, model_parameters=None,
                 training_data=None, lr_scheduler=None, collate_fn=None, dist_init_required=None,
                 registry=None, auto_values: Optional[Dict[str, Any]] = None, mpu=None):
        super().__init__()
        if model is None:
            raise ModelRequiredError("dsplug.initialize: model is required (a torch.nn.Module); note that "
                                     "initialize's first positional argument is args, so pass model=...")
        self.registry = registry or get_registry()
        # the config first (at the world size the group will have): its comm_timeout_s is the
        # timeout the group is created with (or re-applied to a group made before the engine)
        groups.set_mpu(mpu)  # the data-parallel group is the mpu's (the world without one)
        self.config = config if isinstance(config, DsplugConfig) else DsplugConfig(
            config, world_size=groups._get_data_parallel_world_size() if mpu is not None else
            comm.planned_world_size(dist_init_required), registry=self.registry,
            auto_values=auto_values, hidden_size=model_hidden_size(model), strict_auto=True)
        kernel = self.config.kernel
        comm.init_distributed(dist_init_required=dist_init_required, verbose=False, timeout=kernel.comm_timeout_s)
        self.world_size = groups._get_data_parallel_world_size()  # DeepSpeed's dp_world_size
        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.mpu = mpu
        if kernel.seed is not None:
            torch.manual_seed(kernel.seed)
        self.accelerator = get_accelerator(self.registry)
        self.device = self.accelerator.training_device(self.local_rank)
        self.context = BuildContext(config=self.config, accelerator=self.accelerator, comm=groups.data_parallel_comm(),
                                    rank=groups._get_data_parallel_rank(), world_size=self.world_size,
                                    local_rank=self.local_rank, mp_rank=groups._get_model_parallel_rank(),
                                    mp_world_size=groups._get_model_parallel_world_size(), model=model,
                                    registry=self.registry)
        self.precision = self._build_selected("precision")
        groups.refuse_per_slice_decisions(kernel, self.precision)
        self.events = self._build_event_bus()  # before any collective, so loggers see them all
        self.compression = self._build_compression()
        for method in self.compression:
            model = method.compress(model)
        self.context.model = self.module = model
        self._place_model()
        self.before_zero_stage(model)
        self.stage = self._build_stage(model, clients.param_groups(model, model_parameters, optimizer), optimizer)
        self.basic_optimizer = self.stage.optimizer  # DeepSpeed's name for the optimizer under its wrapper
        self.optimizer = self._optimizer_as_deepspeed_returns()
        self.lr_scheduler = clients.build_scheduler(self, lr_scheduler, optimizer)
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn) \
            if training_data is not None else None
        self.counters = EngineCounters()
        self._step_applied = False
        self._boundary_flag: Optional[bool] = None  # set_gradient_accumulation_boundary()
        self._publish_step_result(applied=True)
        self._losses: List[torch.Tensor] = []
        self.timers = StepTimers(self.accelerator, enabled=kernel.wall_clock_breakdown)
        for part in (self.counters, SchedulerState(self), self.precision, self.stage, *self.compression):
            self._join(part)
        self._plugin_methods = events.engine_methods(self.events, self)
        self.events.hook.dsplug_engine_built.call_historic(kwargs={"engine": self})
        if kernel.dump_state:
            self.dump_state()

    def __getattr__(self, name: str):
        """Parameters, buffers and submodules (torch's), then the methods plugins add to the engine,
        then -- as DeepSpeed's engine does -- the wrapped model's own attributes (``engine.id``,
        ``engine.generate`` of a model that has them)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            methods = self.__dict__.get("_plugin_methods") or {}
            if name in methods:
                return methods[name]
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                model = type(module).__name__
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor has its "
                                 f"model, {model})") from None

    # ------------------------------------------------------------------ extension points for subclasses
    # An engine subclass (the class a ``dsplug_engine_factory`` hook returns, see
    # docs/writing-plugins.md) overrides the public methods of this class (``forward``, ``step``,
    # ``load_checkpoint`` ...), overrides ``before_zero_stage``, and attaches parts of its own with
    # ``add_observer``. Methods and attributes whose names start with ``_`` are not a contract.
    def before_zero_stage(self, model) -> None:
        """Called once by ``__init__``, after the precision, the compression methods and the model's
        placement on its device (``self.config``, ``self.context``, ``self.precision``,
        ``self.module``, ``self.reduction_groups`` are set) and before the ZeRO stage -- and with it the
        optimizer -- is built. Raise to refuse a combination the subclass cannot train (the
        pipeline engine refuses ZeRO stages 2 and 3 here); the error reaches the caller of
        ``initialize``. The base engine does nothing."""

    # ------------------------------------------------------------------ construction
    def _build_selected(self, category: str, *args):
        provided, section = self.config.selection(category)
        return provided.spec.factory(*args, section, self.context)

    def _place_model(self) -> None:
        self.module.to(self.device)
        if self.precision.model_dtype not in (None, torch.float32):
            self.module.to(self.precision.model_dtype)
        #: the process groups plugins created for the module's parameters (dsplug_reduction_groups:
        #: MoE experts' groups); [] when every parameter is averaged over the data-parallel group
        self.reduction_groups = sorted({name for names in self.registry.pm.hook.dsplug_reduction_groups(
            model=self.module, context=self.context) for name in (names or [])})
        groups.broadcast_module_state(self.module, self.context)  # at one rank too, as DeepSpeed (the comms log shows it)

    def _build_stage(self, model, param_groups, client_optimizer):
        previous = stage_of(model)
        if previous is not None:  # initialize() again on the same model: retire the old engine's hooks
            log_rank0("warning: this model was already wrapped by a dsplug engine; that engine's hooks are "
                      "removed and it must not be used any more", logging.WARNING)
            previous.close()
        stage = self._build_selected("zero_stage", model, param_groups,
                                     clients.optimizer_builder(self, client_optimizer), self.precision)
        attach_stage(model, stage)
        return stage

    def _build_event_bus(self) -> pluggy.PluginManager:
        """The engine's own plugin manager for lifecycle hooks: enabled observers and monitors,
        module-level lifecycle plugins, and (joined later) the parts with checkpoint state."""
        self.events = bus = events.new_bus()
        self.observers = []
        for provided in self.registry.all():
            section = provided.spec.section
            if provided.category not in ("monitor", "observer") or section not in self.config.sections:
                continue
            observer = provided.spec.factory(self.config.sections[section], self.context)
            if observer is not None:
                self._join(observer, name=f"{provided.category}:{provided.name}")
                self.observers.append(observer)
        for plugin in self.registry.lifecycle_plugins():
            self._join(plugin, name=self.registry.pm.get_name(plugin))
        return bus

    def _build_compression(self) -> list:
        methods = []  # highest spec priority first (layer reduction before the layer methods), then config order
        for provided, section in sorted(self.config.compression, key=lambda pair: -pair[0].spec.priority):
            method = provided.spec.factory(section, self.context)
            if method is not None:  # None: the method's section is disabled
                method.name = provided.name
                methods.append(method)
        return methods

    def _join(self, part, name: Optional[str] = None) -> None:
        """Put ``part`` on the event bus (its lifecycle and checkpoint hookimpls take effect)."""
        events.join(self.events, part, name or f"{type(part).__module__}.{type(part).__qualname__}")

    def add_observer(self, observer, name: Optional[str] = None) -> None:
        """Attach an observer after initialize (it still receives ``dsplug_engine_built``): any
        object whose methods implement lifecycle hooks, checkpoint ones included (an engine
        subclass attaches its own checkpoint participant this way). ``name``: its name on the
        engine's event bus (default: its class's dotted name)."""
        self._join(observer, name)
        self.observers.append(observer)

    # ------------------------------------------------------------------ training
    def forward(self, *inputs, **kwargs):
        kwargs = events.forward_kwargs(self.events, self, kwargs)
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
        self.stage.before_backward(self.is_gradient_accumulation_boundary() and allreduce_gradients)
        self.precision.scale_loss(scaled).backward(retain_graph=retain_graph)
        self.stage.after_backward()
        self.timers.stop("backward")
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """The flag of :meth:`set_gradient_accumulation_boundary` once set, else whether this
        micro-step is the last of ``gradient_accumulation_steps``."""
        if self._boundary_flag is not None:
            return self._boundary_flag
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def step(self, lr_kwargs=None):
        """Call after every micro-step's backward; updates weights at accumulation boundaries."""
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            self.timers.start("step")
            self._step_applied = self.stage.step()
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.counters.skipped_steps += 1
                log_rank0(self.precision.skipped_step_message(self.global_steps + 1), logging.INFO)
            self.counters.global_steps += 1
            self.counters.global_samples += self.train_batch_size()
            self._publish_step_result(self._step_applied)
            self.timers.stop("step")
            self._end_of_step()
        self.counters.micro_steps += 1

    def _end_of_step(self) -> None:
        loss = float(torch.stack([l.float() for l in self._losses]).mean()) if self._losses else float("nan")
        self._losses = []
        metrics = {"loss": loss, "lr": self.get_lr()[0] if self.optimizer is not None else 0.0,
                   "global_samples": float(self.global_samples), "global_steps": float(self.global_steps),
                   "skipped": 0.0 if self._step_applied else 1.0}
        metrics.update(self.precision.step_metrics())
        metrics.update({f"{k}_ms": v for k, v in self.timers.collect().items()})
        self.events.hook.dsplug_step_end(engine=self, metrics=metrics)
        if self.global_steps % self.config.steps_per_print == 0:
            self._print_progress(metrics)

    def _print_progress(self, metrics) -> None:
        parts = [f"step={self.global_steps}", f"skipped={self.skipped_steps}", f"lr={self.get_lr()}",
                 f"mom={self.get_mom()}", f"loss={metrics['loss']:.6g}"]
        parts += [f"{k}={v:g}" for k, v in self.precision.step_metrics().items()]
        if self.timers.enabled:
            parts += [f"{k}={metrics[k]:.2f}" for k in ("forward_ms", "backward_ms", "step_ms") if k in metrics]
        if self.config.memory_breakdown:
            parts.append(f"mem_allocated={self.accelerator.memory_allocated() / 2**20:.1f}MiB")
        log_rank0("[dsplug] " + ", ".join(parts), log=step_logger)

    def zero_grad(self) -> None:
        self.stage.zero_grad()

    # ------------------------------------------------------------------ counters (checkpointed)
    global_steps = EngineCounters.field("global_steps")
    global_samples = EngineCounters.field("global_samples")
    micro_steps = EngineCounters.field("micro_steps")
    skipped_steps = EngineCounters.field("skipped_steps")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """Save to ``save_dir/tag`` (default ``global_step<N>``), crash-safe: the staged tag replaces
        the old one and ``latest`` moves only after every rank wrote its files. A failure on any
        rank raises on every rank (none is left waiting) and leaves the previous checkpoint as is."""
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Load ``load_dir/tag`` (default: the tag in ``latest``); returns ``(path, client_state)``,
        or ``(None, None)`` when there is nothing to load."""
        return load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only, custom_load_fn=custom_load_fn)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Save the full module weights in the training dtype to ``save_dir/save_filename`` (rank 0).
        Returns False, saving nothing, when the ZeRO stage cannot gather them (it says why)."""
        import os

        from . import checkpoint as ckpt

        state = self.stage.sixteen_bit_state_dict()  # a collective when partitioned
        if state is None:
            return False
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            ckpt.atomic_save(state, os.path.join(os.fspath(save_dir), save_filename))
        comm.barrier()
        return True

    # ------------------------------------------------------------------ lifecycle
    def empty_partition_cache(self) -> None:
        """Free the full values of partitioned parameters gathered now (ZeRO stage 3; the other
        stages keep none), then the accelerator's cached memory. Call it between steps."""
        import gc

        self.stage.release_gathered()
        gc.collect()
        self.accelerator.empty_cache()

    def destroy(self) -> None:
        """Close monitors' files and remove hooks; the engine is unusable afterwards."""
        self.events.hook.dsplug_engine_closed(engine=self)
        self.stage.close()
        detach_stage(self.module, self.stage)
        if self.mpu is not None and groups.get_mpu() is self.mpu:
            groups.set_mpu(None)  # the process-wide data-parallel answers return to the world
