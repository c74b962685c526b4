"""``PipelineEngine``: what ``dsplug.initialize(model=PipelineModule, ...)`` returns.

It is the ordinary engine (:class:`dsplug.engine.Engine`) for this rank's stage -- the stage's
layers are an ordinary module to it: precision, ZeRO stage (0 or 1), optimizer, scheduler,
monitors and checkpoints are the configured plugins, built over the grid's data-parallel group
(the grid is the engine's ``mpu``). What differs is the schedule: :meth:`train_batch` runs
``gradient_accumulation_steps`` micro-batches through the stages with the 1F1B schedule
(:mod:`.schedule`), activations and their gradients travelling point-to-point between
neighbouring stages (:mod:`.p2p`), and then:

1. the tied weights' gradients are summed over the stages that share them: their gradients are
   collected aside during the micro-batches (a hook on the weight hands the stage zeros), summed
   over the tied group, and handed to the stage in one more backward pass on the weights alone;
2. that backward pass is the ZeRO stage's accumulation boundary, so the stage averages the
   accumulated gradients over the stage's data-parallel replicas as it does for any model;
3. the mean loss (over micro-batches, then data-parallel replicas) is broadcast from the last
   stage to every stage, and the engine's step updates the weights.

The last stage's backward is the engine's own (loss divided by the accumulation steps, scaled by
the precision); the other stages run autograd from their outputs with the received gradients,
which already carry both factors.

Refused, with the reason: ZeRO stages 2 and 3 (DeepSpeed refuses them with pipelines too);
``gradient_clipping`` and fp16 with more than one stage (the ZeRO stages take the gradient norm
and the overflow check over the data-parallel group only, so the stages of one model would clip
and skip differently); ``forward`` / ``backward`` / ``step`` called directly.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from dsplug import comm
from dsplug.dataloader import RepeatingLoader
from dsplug.engine import Engine
from dsplug.logging import log_rank0

from . import schedule as sched
from .checkpoint import PipelineCheckpoint
from .module import PipelineError, PipelineModule
from .p2p import Link, as_tensors


class PipelineEngine(Engine):
    """The engine of one pipeline stage (DeepSpeed's ``PipelineEngine`` API)."""

    def __init__(self, model, config, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
                 collate_fn=None, dist_init_required=None, registry=None, auto_values=None, mpu=None):
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine trains a dsplug.pipe.PipelineModule, got {type(model).__name__}")
        if mpu is not None:
            raise PipelineError("dsplug.initialize: with a PipelineModule the model-parallel unit is the module's own "
                                "grid (model.mpu()); pass mpu=None")
        super().__init__(model=model, config=config, optimizer=optimizer, model_parameters=model_parameters,
                         training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                         dist_init_required=dist_init_required, registry=registry, auto_values=auto_values,
                         mpu=model.mpu())
        self.grid = model.mpu()
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.get_stage_id()
        self.micro_batches = self.gradient_accumulation_steps()
        prev_rank, next_rank = self.grid.prev_stage_rank(), self.grid.next_stage_rank()
        self.prev_link = Link(comm, prev_rank, self.device, model.dynamic_shape) if prev_rank is not None else None
        self.next_link = Link(comm, next_rank, self.device, model.dynamic_shape) if next_rank is not None else None
        self._link_mode: Optional[str] = None
        self.data_iterator = None
        self.batch_fn = None
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.agg_eval_loss: Optional[torch.Tensor] = None
        self._tied = [(key, attr, p, group) for key, attr, p, group in model.tied_parameters() if p.requires_grad]
        self._tied_grads: List[Optional[torch.Tensor]] = [None] * len(self._tied)
        self._capturing = True
        self._tied_hooks = [p.register_hook(self._capture(i)) for i, (_k, _a, p, _g) in enumerate(self._tied)]
        self.add_observer(PipelineCheckpoint(self), name="pipe.checkpoint")
        if self.training_dataloader is not None:
            self.set_dataloader(self.training_dataloader)
        log_rank0(f"[dsplug] pipeline: {self.num_stages} stage(s) x {self.grid.data_parallel_size} data-parallel "
                  f"replica(s); stage boundaries {model.parts}; {self.micro_batches} micro-batch(es) per batch")

    # ------------------------------------------------------------------ construction checks
    def before_zero_stage(self, model) -> None:
        """Refuse what a pipeline cannot train, before the ZeRO stage is built (the engine's
        extension point)."""
        provided, _section = self.config.selection("zero_stage")
        if str(provided.name) in ("2", "3"):
            raise PipelineError(f"zero_optimization.stage {provided.name} cannot be combined with pipeline "
                                "parallelism (as in DeepSpeed); use stage 0 or 1")
        if self.reduction_groups:  # the union over every rank (the MoE plugin's dsplug_reduction_groups)
            raise PipelineError("MoE expert parameters (dsplug.moe layers) in a PipelineModule are not available in "
                                "dsplug: the pipeline's data-parallel groups and the expert groups are not combined yet")
        if self.context.comm.get_backend() == "nccl" and model.num_pipeline_stages() > 1:
            raise PipelineError("pipeline parallelism over NCCL is not available in dsplug yet: its 1F1B schedule "
                                "posts a send before the matching receive in both directions, which NCCL can "
                                "deadlock on; run the pipeline over gloo")
        # gradient_clipping and fp16 across stages: refused by the kernel for any mpu of several slices
        # (dsplug.comm.groups.refuse_per_slice_decisions); the grid's model-parallel slices are the stages

    # ------------------------------------------------------------------ DeepSpeed's stage questions
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    def is_data_parallel(self) -> bool:
        return self.grid.data_parallel_size > 1

    # ------------------------------------------------------------------ data
    def set_dataiterator(self, iterator) -> None:
        """The iterator of ``(inputs, labels)`` micro-batches (read on the first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        """Iterate ``loader`` forever (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(RepeatingLoader(loader))

    def set_batch_fn(self, fn) -> None:
        """``fn(batch)`` is applied to every micro-batch read from the data iterator."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """The next activation sent on each link is described again (call it on every rank)."""
        for link in (self.prev_link, self.next_link):
            if link is not None:
                link.reset()

    # ------------------------------------------------------------------ the public API refuses the plain path
    def forward(self, *args, **kwargs):
        raise PipelineError("only train_batch() and eval_batch() are accessible in pipeline mode")

    def backward(self, *args, **kwargs):
        raise PipelineError("only train_batch() and eval_batch() are accessible in pipeline mode")

    def step(self, *args, **kwargs):
        raise PipelineError("only train_batch() and eval_batch() are accessible in pipeline mode")

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Train on one batch (``gradient_accumulation_steps`` micro-batches, 1F1B) and step.

        Returns the loss averaged over the micro-batches and the data-parallel replicas, on every
        stage (the last stage computes it and broadcasts it)."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() requires gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._switch_links("train")
        self._run(sched.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id), train=True,
                  compute_loss=True)
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True, num_micro_batches=None):
        """Forward ``num_micro_batches`` (default: ``gradient_accumulation_steps``) micro-batches
        from ``data_iter`` without gradients.

        ``reduce_output='avg'``: the loss (or, with ``compute_loss=False``, the last stage's output)
        averaged over the micro-batches and the data-parallel replicas; with ``bcast_loss`` a scalar
        result is broadcast to every stage (else only the last stage has it, the others get None).
        ``reduce_output=None``: the list of per-micro-batch values on the last stage. With
        ``return_logits`` the result is ``(value, outputs)``, ``outputs`` being the last stage's
        outputs of every micro-batch (None on the other stages)."""
        if reduce_output not in ("avg", None):
            raise PipelineError(f"eval_batch: reduce_output={reduce_output!r}; use 'avg' or None")
        micro_batches = int(num_micro_batches) if num_micro_batches is not None else self.micro_batches
        saved_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        self.module.eval()
        self._switch_links("eval")
        try:
            with torch.no_grad():
                result = self._run(sched.InferenceSchedule(micro_batches, self.num_stages, self.stage_id),
                                   train=False, compute_loss=compute_loss)
        finally:
            self.data_iterator = saved_iterator
        values, logits = result
        output = None
        if self.is_last_stage():
            output = values if reduce_output is None else self._reduce_outputs(values)
        if reduce_output == "avg" and bcast_loss and compute_loss and self.is_pipe_parallel():
            output = self._broadcast_from_last(output)
        if compute_loss and reduce_output == "avg":
            self.agg_eval_loss = output
        if return_logits:
            return output, logits
        return output

    def _switch_links(self, mode: str) -> None:
        """Shapes of training and evaluation micro-batches may differ: describe them again when
        the mode changes (every rank calls train_batch / eval_batch alike)."""
        if self._link_mode is not None and self._link_mode != mode:
            self.reset_activation_shape()
        self._link_mode = mode

    # ------------------------------------------------------------------ running a schedule
    def _run(self, schedule, train: bool, compute_loss: bool):
        state = _BatchState()
        handlers = {
            sched.LoadMicroBatch: self._load_micro_batch,
            sched.RecvActivation: self._recv_activation,
            sched.ForwardPass: self._forward_pass,
            sched.SendActivation: self._send_activation,
            sched.RecvGrad: self._recv_grad,
            sched.BackwardPass: self._backward_pass,
            sched.SendGrad: self._send_grad,
            sched.ReduceTiedGrads: self._reduce_tied_grads,
            sched.ReduceGrads: self._reduce_grads,
            sched.OptimizerStep: self._optimizer_step,
        }
        state.train, state.compute_loss = train, compute_loss
        links = [link for link in (self.prev_link, self.next_link) if link is not None]
        try:
            for step in schedule:
                for instruction in step:
                    handlers[type(instruction)](state, instruction)
        except BaseException:
            for link in links:  # a failed batch: its sends may never be received, do not wait for them
                link.pending = []
            raise
        for link in links:
            link.wait()
        return state.values, (state.logits if self.is_last_stage() else None)

    def _next_batch(self):
        if self.data_iterator is None:
            raise PipelineError("the pipeline has no data: pass data_iter to train_batch / eval_batch, "
                                "training_data to dsplug.initialize, or call engine.set_dataiterator()")
        batch = next(self.data_iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
            raise PipelineError(f"a pipeline micro-batch must be a pair (inputs, labels), got "
                                f"{type(batch).__name__}{size}")
        return batch

    def _to_device(self, value):
        if torch.is_tensor(value):
            return value.to(self.device)
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v) for v in value)
        return value

    def _load_micro_batch(self, state, ins) -> None:
        inputs, labels = self._next_batch()
        if self.is_first_stage():
            inputs = self._to_device(inputs)
            if state.train and self.module.activation_checkpoint_interval > 0:
                # a checkpointed first chunk needs an input that requires grad for its parameters' gradients
                inputs = _requiring_grad(inputs)
            state.inputs[ins.micro_batch] = inputs
        if self.is_last_stage():
            state.labels[ins.micro_batch] = self._to_device(labels)

    def _recv_activation(self, state, ins) -> None:
        state.inputs[ins.micro_batch] = self.prev_link.recv_activation()

    def _forward_pass(self, state, ins) -> None:
        mb = ins.micro_batch
        outputs = Engine.forward(self, state.inputs[mb] if state.train else state.inputs.pop(mb))
        if self.is_last_stage():
            loss_fn = self.module.loss_fn
            if state.compute_loss and loss_fn is not None:
                value = loss_fn(outputs, state.labels.pop(mb))
            else:
                state.labels.pop(mb, None)
                value = outputs
            if state.train:
                if not (torch.is_tensor(value) and value.numel() == 1):
                    raise PipelineError("the last stage's loss must be a tensor with one element (give the "
                                        "PipelineModule a loss_fn, or make the last layer return the loss); got "
                                        f"{type(value).__name__}{tuple(value.shape) if torch.is_tensor(value) else ''}")
                state.losses[mb] = value
            else:
                state.values.append(_detached(value))
                state.logits.append(_detached(outputs))
        else:
            state.outputs[mb] = outputs

    def _send_activation(self, state, ins) -> None:
        outputs = state.outputs[ins.micro_batch] if state.train else state.outputs.pop(ins.micro_batch)
        self.next_link.send_activation(outputs)

    def _recv_grad(self, state, ins) -> None:
        state.grads[ins.micro_batch] = self.next_link.recv_grads(as_tensors(state.outputs[ins.micro_batch])[1])

    def _backward_pass(self, state, ins) -> None:
        mb = ins.micro_batch
        if self.is_first_stage():
            state.inputs.pop(mb)  # the first stage sends no gradient back: its inputs are done with
        if self.is_last_stage():
            loss = state.losses.pop(mb)
            state.values.append(loss.detach())
            Engine.backward(self, loss, allreduce_gradients=False)  # divides by the accumulation steps, scales
            return
        outputs = [t for t in as_tensors(state.outputs.pop(mb))[1] if t.is_floating_point()]
        grads = state.grads.pop(mb)
        pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
        self.timers.start("backward")
        self.stage.before_backward(False)
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
        self.stage.after_backward()
        self.timers.stop("backward")

    def _send_grad(self, state, ins) -> None:
        inputs = as_tensors(state.inputs.pop(ins.micro_batch))[1]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
        self.prev_link.send_grads(grads)

    # ------------------------------------------------------------------ tied weights and the step
    def _capture(self, index: int):
        """Tensor hook of tied weight ``index``: keep its gradient aside (summed over micro-batches,
        fp32) and hand the ZeRO stage zeros, until the tied reduction hands it the sum."""
        def hook(grad):
            if not self._capturing:
                return None
            held = self._tied_grads[index]
            if held is None:
                self._tied_grads[index] = grad.detach().to(torch.float32, copy=True)
            else:
                held.add_(grad.detach())
            return torch.zeros_like(grad)

        return hook

    def _reduce_tied_grads(self, state, ins) -> None:
        for i, (_key, _attr, p, group) in enumerate(self._tied):
            if self._tied_grads[i] is None:
                self._tied_grads[i] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            comm.all_reduce(self._tied_grads[i], group=group)

    def _reduce_grads(self, state, ins) -> None:
        """The accumulation boundary: the tied weights' summed gradients go in as one more backward
        pass, during which (and after which) the ZeRO stage reduces over the data-parallel group."""
        self.stage.before_backward(True)
        if self._tied:
            self._capturing = False
            try:
                torch.autograd.backward([p for _k, _a, p, _g in self._tied],
                                        grad_tensors=[g.to(p.dtype) for (_k, _a, p, _g), g in
                                                      zip(self._tied, self._tied_grads)])
            finally:
                self._capturing = True
        self.stage.after_backward()
        self._tied_grads = [None] * len(self._tied)

    def _optimizer_step(self, state, ins) -> None:
        for link in (self.prev_link, self.next_link):
            if link is not None:
                link.wait()
        self.agg_train_loss = self._aggregate_loss(state.values)
        self._losses = [self.agg_train_loss]  # what the step reports to monitors, on every stage
        self.counters.micro_steps += self.micro_batches - 1  # the step below counts one
        self._boundary_flag = True
        try:
            Engine.step(self)
        finally:
            self._boundary_flag = None

    # ------------------------------------------------------------------ losses
    def _aggregate_loss(self, losses: List[torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches (last stage), over data-parallel replicas, broadcast to every stage."""
        if self.is_last_stage():
            value = torch.stack([l.detach().float().reshape(()) for l in losses]).mean()
            if self.is_data_parallel():
                comm.all_reduce(value, group=self.grid.get_data_parallel_group())
                value = value / self.grid.data_parallel_size
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_pipe_parallel():
            value = self._broadcast_from_last(value)
        return value

    def _broadcast_from_last(self, value) -> torch.Tensor:
        holder = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            if not (torch.is_tensor(value) and value.numel() == 1):
                raise PipelineError("eval_batch: only a scalar loss can be broadcast to every stage "
                                    "(pass bcast_loss=False, or reduce_output='avg' with compute_loss=True)")
            holder.copy_(value.detach().float().reshape(1))
        comm.broadcast(holder, src=self.grid.stage_to_global(self.num_stages - 1),
                       group=self.grid.get_pipe_parallel_group())
        return holder.reshape(())

    def _reduce_outputs(self, values):
        """Average per-micro-batch values (tensors, or tuples of tensors) over micro-batches and the
        data-parallel replicas."""
        if not values:
            return None
        if torch.is_tensor(values[0]):
            mean = torch.stack([v.float() for v in values]).mean(dim=0)
            return self._dp_mean(mean)
        return type(values[0])(self._dp_mean(torch.stack([v[i].float() for v in values]).mean(dim=0))
                               for i in range(len(values[0])))

    def _dp_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.is_data_parallel():
            tensor = tensor.clone()
            comm.all_reduce(tensor, group=self.grid.get_data_parallel_group())
            tensor /= self.grid.data_parallel_size
        return tensor

    # ------------------------------------------------------------------ checkpoints
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Load a checkpoint; one saved with another stage count or partition is loaded layer by
        layer (module weights, optimizer state, counters, scheduler, precision, client state)."""
        from .checkpoint import load_pipeline_checkpoint

        flags = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                     load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                     custom_load_fn=custom_load_fn)
        return load_pipeline_checkpoint(self, load_dir, tag, flags,
                                        same_layout=lambda tag_: Engine.load_checkpoint(self, load_dir, tag_, **flags))

    def destroy(self) -> None:
        from dsplug.comm import groups

        for h in self._tied_hooks:
            h.remove()
        self._tied_hooks = []
        super().destroy()
        if groups.get_mpu() is self.grid:  # the grid stops being the process's model-parallel unit
            groups.set_mpu(None)


class _BatchState:
    """What one batch's schedule keeps between instructions, by micro-batch."""

    def __init__(self):
        self.inputs: Dict[int, Any] = {}
        self.labels: Dict[int, Any] = {}
        self.outputs: Dict[int, Any] = {}
        self.grads: Dict[int, List[torch.Tensor]] = {}
        self.losses: Dict[int, torch.Tensor] = {}
        self.values: List[Any] = []   # per micro-batch: losses (train) or outputs / losses (eval), in order
        self.logits: List[Any] = []
        self.train = True
        self.compute_loss = True


def _detached(value):
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


def _requiring_grad(value):
    if torch.is_tensor(value):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    if isinstance(value, (tuple, list)):
        return type(value)(_requiring_grad(v) for v in value)
    return value

