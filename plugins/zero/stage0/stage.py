"""ZeRO stage 0: plain data parallelism with mixed-precision master weights.

Every rank holds everything. Gradients are averaged over ranks once per optimizer step: during
the backward pass of the last micro-step, gradients are copied into fixed-size buckets (in the
order backward produces them) and each full bucket's all-reduce starts asynchronously, so
communication overlaps the rest of backward. Between micro-steps gradients accumulate locally
(in ``grad_accum_dtype``).

At the step: the averaged gradients become the fp32 master gradients, are unscaled (fp16),
checked for overflow, clipped to the global norm, and the optimizer updates the master weights,
which are copied back into the (possibly 16-bit) model parameters.

An optimizer whose ``communicates_gradients()`` is True at the last micro-step's backward (1-bit
Adam's compression stage, see :class:`dsplug.contracts.Optimizer`) averages over the ranks
itself: that step's gradients are not all-reduced and the optimizer gets this rank's LOCAL
gradients. The overflow check (fp16) then agrees over the ranks (a found-inf flag all-reduced
with MAX, so every rank skips the same steps), while gradient clipping and the reported gradient
norm use this rank's local norm.

In a world of one process there is nothing to average and no bucket is built -- unless something
watches the collectives (the comms logger, on ``dsplug.comm.events`` when the stage is built):
then the buckets are all-reduced over the one rank (an identity), as DeepSpeed always does, so
that a comms log at one rank shows what more ranks would send.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from dsplug import comm
from dsplug.contracts import ZeroStage

from ..checkpoint import deepspeed_format as dsf
from ..partitioning.gradients import comm_dtype, unscale_check_clip
from ..partitioning.reductions import OVERLAP_BUCKET_ELEMENTS, overlap_bucket_elements, reduction_domains
from .buckets import GradientBuckets
from .traits import TRAITS


class DataParallelStage(dsf.DeepSpeedInterchange, ZeroStage):
    """Checkpoints are DeepSpeed's stage-0 layout: the optimizer state (with the fp32 master weights
    in bf16 / fp16) is saved once, in the shared file under ``"optimizer"`` (as DeepSpeed keeps it);
    each rank's ``"stage"`` only says so."""

    stage = 0
    traits = TRAITS

    def __init__(self, module: torch.nn.Module, param_groups: List[dict], build_optimizer, precision, zero_config,
                 kernel_config, context):
        self.module = module
        self.precision = precision
        self.context = context
        self.comm = context.comm
        self.world_size = context.world_size
        self.clip = float(kernel_config.gradient_clipping or 0.0)
        self.params: List[torch.nn.Parameter] = [p for g in param_groups for p in g["params"]]
        if precision.master_weights:
            self.master: Dict[torch.nn.Parameter, torch.Tensor] = {
                p: p.detach().to(torch.float32).clone().requires_grad_(False) for p in self.params
            }
            groups = [{**g, "params": [self.master[p] for p in g["params"]]} for g in param_groups]
        else:
            self.master = {}
            groups = param_groups
        self.optimizer = build_optimizer(groups)
        accum = precision.grad_accum_dtype or precision.model_dtype
        self.accum_dtype = accum
        self.accumulators: Dict[torch.nn.Parameter, torch.Tensor] = {}
        reduce_dtype = comm_dtype(kernel_config, accum)
        #: the parameters by where their gradients are averaged (``context.reduction_of``; key None:
        #: the data-parallel group): {key: (reduction, params)}
        self.domains = reduction_domains(self.params, context.reduction_of)
        self.buckets = BucketSets([GradientBuckets(
            params, bucket_elements=_bucket_elements(zero_config), comm=reduction.comm, world_size=reduction.divisor,
            dtype=reduce_dtype, prescale=kernel_config.prescale_gradients,
            predivide=kernel_config.gradient_predivide_factor, grad_of=self._grad_of, set_grad=self._set_grad,
        ) for reduction, params in self.domains.values()]) if self.world_size > 1 or comm.events.watching else None
        self._boundary = True
        self._local_grads = False  # this step's optimizer averages over the ranks itself
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.last_grad_norm: Optional[float] = None
        #: parameters averaged outside the data-parallel group: their values and optimizer state differ between ranks
        self.varies_by_rank = any(key is not None for key in self.domains)
        if self.varies_by_rank and self.world_size > 1 and callable(getattr(self.optimizer, "communicates_gradients",
                                                                            None)):
            what = next(r.what for key, (r, _) in self.domains.items() if key is not None)
            raise ValueError(f"optimizer {type(self.optimizer).__name__} averages its own (compressed) gradients over "
                             f"the data-parallel group, which would mix the {what} that differ between ranks; train "
                             "with an optimizer that leaves the reduction to the ZeRO stage (e.g. Adam, AdamW)")

    # ------------------------------------------------------------------ backward
    def _needs_accumulator(self, p) -> bool:
        return p.dtype != self.accum_dtype

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._needs_accumulator(p):
            acc = self.accumulators.get(p)
            if acc is None:
                self.accumulators[p] = p.grad.detach().to(self.accum_dtype)
            else:
                acc.add_(p.grad.detach())
            p.grad = None
        if self._boundary and self.buckets is not None:
            self.buckets.mark_ready(p)

    def _grad_of(self, p) -> Optional[torch.Tensor]:
        return self.accumulators.get(p) if self._needs_accumulator(p) else p.grad

    def _set_grad(self, p, grad: torch.Tensor) -> None:
        if self._needs_accumulator(p):
            self.accumulators[p] = grad.to(self.accum_dtype)
        else:
            p.grad = grad.to(p.dtype)

    def before_backward(self, is_boundary: bool) -> None:
        if is_boundary and self.buckets is not None:
            self._local_grads = _communicates_gradients(self.optimizer)
            is_boundary = not self._local_grads
        self._boundary = is_boundary
        if is_boundary and self.buckets is not None:
            self.buckets.start_round()

    def after_backward(self) -> None:
        if self._boundary and self.buckets is not None:
            self.buckets.finish_round()

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Apply one optimizer step; return False if an overflow skipped it."""
        grads = self._master_grads()
        # the norm costs a pass over every gradient: only when clipping or overflow checks need it
        norm = self._agreed_local_norm if self._local_grads else \
            self._norm_over_shards if self.varies_by_rank else _global_norm
        self._local_grads = False
        apply, self.last_grad_norm = unscale_check_clip(grads, self.precision, self.clip, norm, norm_always=False)
        if not apply:
            self.zero_grad()
            return False
        self.optimizer.step()
        if self.master:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], [self.master[p] for p in self.params])
        self.zero_grad()
        return True

    def _norm_over_shards(self, grads: List[torch.Tensor]) -> float:
        """The global norm with parameters whose values differ between ranks: the gradients
        reduced over the data-parallel group are the same on every rank after the reduction; the
        others are this rank's own -- their squares are summed over their reduction's
        ``shard_comm`` (which holds each value once). Every rank then clips and checks overflow
        with the same value."""
        key_of = {p: key for key, (_r, params) in self.domains.items() for p in params}
        by_key: Dict[Optional[str], List[torch.Tensor]] = {}
        for p, g in zip(self.params, grads):
            by_key.setdefault(key_of[p], []).append(g)
        total = _global_norm(by_key.pop(None, [])) ** 2
        for key in sorted(by_key):
            square = torch.tensor([_global_norm(by_key[key]) ** 2], dtype=torch.float64,
                                  device=by_key[key][0].device)  # NCCL reduces device tensors only
            shards = self.domains[key][0].shard_comm
            if shards is not None and shards.get_world_size() > 1:
                shards.all_reduce(square)
            total += float(square)
        return math.sqrt(total) if math.isfinite(total) else total

    def _agreed_local_norm(self, grads: List[torch.Tensor]) -> float:
        """This rank's norm; inf on every rank when any rank's is not finite (overflow checks)."""
        norm = _global_norm(grads)
        if self.precision.checks_overflow:
            flag = torch.tensor([0.0 if math.isfinite(norm) else 1.0],
                                device=grads[0].device if grads else
                                self.context.accelerator.training_device(self.context.local_rank))
            self.comm.all_reduce(flag, op=self.comm.ReduceOp.MAX)
            if flag.item() > 0:
                return float("inf")
        return norm

    def _master_grads(self) -> List[torch.Tensor]:
        grads = []
        for p in self.params:
            g = self._grad_of(p)
            if g is None:
                g = torch.zeros_like(p, dtype=torch.float32 if self.master else p.dtype)
            target = self.master[p] if self.master else p
            if self.master:
                target.grad = g.to(torch.float32) if g.dtype != torch.float32 else g
            else:
                target.grad = g
            grads.append(target.grad)
        return grads

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master.values():
            m.grad = None
        self.accumulators.clear()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.master:
            state["master_weights"] = [self.master[p] for p in self.params]
        return state

    # ------------------------------------------------------------------ checkpoint hooks
    def _ds_rank_state(self) -> dict:
        if self.varies_by_rank:  # ranks differ: each rank's file holds its own state and own parameter values
            return {"zero_stage": 0, **self.state_dict(), "rank_params": [p.detach() for p in self._rank_params()],
                    "rank_layout": self._rank_layout()}
        return {"zero_stage": 0, "optimizer_in_model_file": True}

    def _ds_rank_keys(self, engine, state, options) -> dict:
        return {}

    def _ds_model_keys(self, engine) -> dict:
        steps = int(getattr(engine, "global_steps", 0) or 0)
        return dsf.model_keys(self, param_shapes=None, world_size=self.world_size,
                              optimizer=dsf.stage0_optimizer(self, steps))

    def _load_native(self, checkpoint):
        state = checkpoint.rank.get("stage")
        if isinstance(state, dict) and state.get("optimizer_in_model_file") and not checkpoint.options.load_module_only:
            checkpoint.rank["stage"] = dsf.stage0_state(checkpoint.model.get("optimizer"))
        return super()._load_native(checkpoint)

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True, **_unused) -> None:
        """Every rank saved the same replicated state, so this rank's (or any) file will do."""
        if "optimizer" not in state:
            from dsplug.checkpoint import CheckpointError

            raise CheckpointError(
                f"this checkpoint holds ZeRO stage {state.get('zero_stage', '?')} partitions, but the engine runs "
                "stage 0: load it with the stage it was saved with, or pass load_module_only=True (or "
                "consolidate it with `dsplug zero-to-fp32`)")
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        own = state.get("rank_params")
        # the shared file holds rank 0's values only: this rank's come from its file -- when the
        # layout is this run's (another layout is the plugin's to map, from files of its own)
        same_layout = not self.varies_by_rank or state.get("rank_layout") == self._rank_layout()
        if own is not None and self.varies_by_rank and same_layout:
            with torch.no_grad():
                for p, value in zip(self._rank_params(), own):
                    p.copy_(value)
        if self.master:
            saved = state.get("master_weights")
            own_params = set(self._rank_params())
            with torch.no_grad():
                for p in self.params:
                    self.master[p].copy_(p.detach().float())
                if saved is not None:
                    for p, w in zip(self.params, saved):
                        if same_layout or p not in own_params:  # another layout: the rank's own keep
                            self.master[p].copy_(w)  # the values their plugin loaded into them

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes this rank holds now: every parameter, gradient (and accumulator), fp32 master and
        optimizer state whole (stage 0 replicates them), and the gradient bucket buffers."""
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()

        trained = set(self.params)
        params = sum(nbytes(p) for p in self.module.parameters())
        grads = sum(nbytes(p.grad) for p in trained) + sum(nbytes(t) for t in self.accumulators.values())
        optim = sum(nbytes(m) for m in self.master.values())
        for state in self.optimizer.state.values():
            optim += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        buffers = sum(nbytes(b) for s in self.buckets.sets for b in s.buffers) if self.buckets is not None else 0
        return {"parameters": params, "gradients": grads, "optimizer_states": optim, "buffers": buffers,
                "total": params + grads + optim}

    def _rank_params(self) -> List[torch.nn.Parameter]:
        """The parameters averaged outside the data-parallel group (their values differ between ranks)."""
        return [p for key, (_r, params) in self.domains.items() if key is not None for p in params]

    def _rank_layout(self) -> dict:
        """What decides which values a rank holds: the world, each such tensor's group and shape,
        and this rank's place among the ranks holding different values (``Reduction.placement``)."""
        key_of = {p: key for key, (_r, params) in self.domains.items() for p in params}
        return {"world_size": self.world_size,
                "params": [(key_of[p], tuple(p.shape)) for p in self._rank_params()],
                "placement": {key: r.placement for key, (r, _p) in self.domains.items() if key is not None}}

    def module_state_dict(self) -> dict:
        """The full module state (every rank holds it whole at stage 0)."""
        return self.module.state_dict()

    def load_module_state_dict(self, state: dict, strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def refresh_master_from_model(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p in self.master:
                    self.master[p].copy_(p.detach().float())

    # ------------------------------------------------------------------ full values (every rank holds them)
    def _target(self, param):
        """The tensor the optimizer steps for ``param`` (its fp32 master, or itself); None if untrained."""
        if not hasattr(self, "_trained_ids"):
            self._trained_ids = {id(p) for p in self.params}
        if id(param) not in self._trained_ids:
            return None
        return self.master[param] if self.master else param

    def full_fp32_param(self, param) -> Optional[torch.Tensor]:
        target = self._target(param)
        return None if target is None else target.detach().to(torch.float32, copy=True)

    def set_full_fp32_param(self, param, value: torch.Tensor) -> None:
        target = self._target(param)
        if target is None:
            return
        with torch.no_grad():
            target.copy_(value)
            if target is not param:
                param.copy_(value)

    def full_grad(self, param) -> Optional[torch.Tensor]:
        if self._target(param) is None:
            return None
        grad = self._grad_of(param)
        if grad is None and self.master:  # inside step(): the master holds it
            grad = self.master[param].grad
        return None if grad is None else grad.detach().to(torch.float32, copy=True)

    def full_optimizer_state(self, param, key: str):
        target = self._target(param)
        value = None if target is None else self.optimizer.state.get(target, {}).get(key)
        if value is None:
            return None
        if torch.is_tensor(value) and value.shape == target.shape:
            return value.detach().to(torch.float32, copy=True)
        return value.clone() if torch.is_tensor(value) else value

    def set_full_optimizer_state(self, param, key: str, value: torch.Tensor) -> None:
        target = self._target(param)
        if target is None:
            return
        state = self.optimizer.state[target]
        with torch.no_grad():
            if key in state and torch.is_tensor(state[key]):
                state[key].copy_(value)
            else:
                state[key] = value.detach().to(device=target.device, dtype=target.dtype, copy=True)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class BucketSets:
    """The bucket sets of the reduction domains (the data-parallel group, then each other) driven as one."""

    def __init__(self, sets: List[GradientBuckets]):
        self.sets = sets

    def start_round(self) -> None:
        for s in self.sets:
            s.start_round()

    def mark_ready(self, p) -> None:
        for s in self.sets:
            s.mark_ready(p)

    def finish_round(self) -> None:
        for s in self.sets:
            s.finish_round()


def _communicates_gradients(optimizer) -> bool:
    ask = getattr(optimizer, "communicates_gradients", None)
    return bool(ask()) if callable(ask) else False


def _global_norm(grads: List[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2)
    return float(torch.linalg.vector_norm(torch.stack(norms), 2))


def _bucket_elements(zero_config) -> int:
    return overlap_bucket_elements(getattr(zero_config, "reduce_bucket_size", OVERLAP_BUCKET_ELEMENTS))
