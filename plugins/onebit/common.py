"""What the three 1-bit optimizers share: Adam-type updates, the flat compressed average, state.

**Flat compressed average.** Whenever an optimizer averages a per-parameter tensor list over the
data-parallel ranks (momentum, or 0/1 Adam's accumulated update), every parameter of a param
group takes part, in ``param_groups[i]["params"]`` order: the tensors, each multiplied by its
*scaling coefficient* s_j, are laid end to end in one float32 buffer zero-padded to
``padded_numel(n, world_size)`` elements, averaged in place by
:class:`~.compressed.CompressedAllReduce` with the group's ``worker_error`` / ``server_error``
buffers (error feedback), and divided by s_j again. The result is identical on every rank.

**Scaling coefficients** (DeepSpeed's 1-bit LAMB ``scaling_coeff``): the compressed all-reduce
uses one scale per rank (||x|| / sqrt(numel)), so tensors of very different magnitude would share
it. When a parameter's compression starts, from the momentum m_j then (identical on all ranks):
``r_j = ||m_j|| / sqrt(numel_j)``, ``s_j = mean_k(r_k) / r_j`` (1 where r_j = 0); kept in the
parameter's state as ``scaling_coeff``. It changes what is lost to compression, not what is
averaged. 1-bit Adam and 1-bit LAMB use them (as DeepSpeed's 1-bit LAMB does); 0/1 Adam instead
gives every tensor its own compression scale (``compressed_average_`` without coefficients, as
DeepSpeed compresses each tensor separately), since its coefficients would be fixed early in the
lr warm-up and its accumulated updates change their relative sizes over training.

**Zero-variance mask** (DeepSpeed's ``exp_avg_mask``, made automatic): 1-bit compression cannot
represent an exact zero, and an element whose second moment v is exactly 0 (it never had a
non-zero gradient) would be updated by m / eps. So in the compressed and local steps, after each
momentum update (and compression), m (and 0/1 Adam's accumulator) is set to 0 wherever v == 0.

**Rank state.** Error-feedback buffers differ between ranks (each rank's own compression error),
and 0/1 Adam's local steps make momentum and parameters differ between synchronisations.
``state_dict()`` holds this rank's view of everything (it round-trips exactly in one process);
:meth:`OneBitOptimizer.rank_state_dict` is the part that differs between ranks, which the plugin
saves in each rank's own checkpoint file at ZeRO stage 0 (the shared file holds rank 0's
``state_dict()``), so a resumed run continues exactly.

**Adam steps with all-reduced gradients** run through the same kernel as the ``AdamW`` optimizer
type (dsplug's native cpu_adam for CPU fp32 parameters when it builds, else torch's fused Adam
kernel, else the multi-tensor formula), so those steps are bit-identical to ``AdamW``.
"""
from __future__ import annotations

import abc

import math
from typing import Dict, List, Optional, Sequence

import torch

from dsplug.ops.multi_tensor import (
    AdamHyper,
    Bucket,
    check_hyperparameters,
    foreach_adam_step,
    fused_adam_step,
    fused_kernel_available,
)

_CPU_ADAM_OP = None


def _cpu_adam_op():
    global _CPU_ADAM_OP
    if _CPU_ADAM_OP is None:
        from dsplug.op_builder import CPUAdamBuilder

        _CPU_ADAM_OP = CPUAdamBuilder().load()
    return _CPU_ADAM_OP


def native_adam_fits(param_groups) -> bool:
    """Whether the ``AdamW`` optimizer type would step these parameters with the native cpu_adam
    op (the kernel's test, :func:`dsplug.ops.adam.cpu_adam.native_cpu_adam_fits`, which it uses)."""
    from dsplug.ops.adam.cpu_adam import native_cpu_adam_fits

    tensors = [p for g in param_groups for p in g["params"]]
    return bool(tensors) and all(p.is_contiguous() for p in tensors) and native_cpu_adam_fits(param_groups)


def scaling_coefficients(tensors: Sequence[torch.Tensor]) -> List[float]:
    """s_j = mean_k(r_k) / r_j with r_j = ||t_j|| / sqrt(numel_j); 1 where r_j is 0."""
    rms = [float(torch.linalg.vector_norm(t.float())) / math.sqrt(t.numel()) if t.numel() else 0.0 for t in tensors]
    if not rms:
        return []
    united = sum(rms) / len(rms)
    return [united / r if r > 0 and united > 0 else 1.0 for r in rms]


#: DeepSpeed's constructor arguments that have no effect here: name -> (DeepSpeed's default, why)
INERT_ARGUMENTS = {
    "eps_inside_sqrt": (False, "DeepSpeed's 1-bit optimizers accept and ignore it"),
    "max_grad_norm": (0.0, "DeepSpeed's 1-bit optimizers accept and ignore it; use gradient_clipping"),
    "cuda_aware": (False, "dsplug moves tensors as its comm backend needs; CUDA-aware MPI is not used"),
    "comm_backend_name": ("nccl", "dsplug always communicates through its comm layer's process group"),
}


def check_deepspeed_arguments(name: str, amsgrad, **inert) -> None:
    """DeepSpeed's extra constructor arguments: ``amsgrad`` must be false; the others warn when
    given a non-default value (they change nothing here)."""
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (the 1-bit optimizers have no AMSGrad variant)")
    import warnings

    for key, value in inert.items():
        default, why = INERT_ARGUMENTS[key]
        if value != default:
            warnings.warn(f"{name}: {key}={value!r} has no effect in dsplug ({why})", stacklevel=3)


class OneBitOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base of OnebitAdam, ZeroOneAdam and OnebitLamb.

    ``comm`` / ``rank`` / ``world_size`` / ``group``: the data-parallel group (the factory takes
    them from the engine's :class:`dsplug.context.BuildContext`); with ``world_size`` 1 nothing
    is communicated or compressed. When none of the three is given (an instance built the way
    DeepSpeed's constructors are called, ``OnebitAdam(params, deepspeed=engine, lr=...)``), the
    group is dsplug's comm world, looked up when the optimizer is first used (so it may be built
    before ``init_distributed``); ``deepspeed`` (DeepSpeed's engine argument) is kept and not
    needed: the engine asks :meth:`communicates_gradients` instead.
    """

    #: ZeRO stages 1-3 hand an optimizer flat slices mixing parameters: these compress and scale
    #: whole tensors, so they are refused there (see dsplug.plugins.zero.partitioning.checks)
    dsplug_elementwise = False
    #: the name in messages
    NAME = "OneBit"
    #: per-parameter state that differs between ranks while :meth:`ranks_diverge`
    LOCAL_KEYS: Sequence[str] = ()

    def __init__(self, params, defaults: dict, comm=None, rank=None, world_size=None, group=None, deepspeed=None):
        check_hyperparameters(self.NAME, defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"])
        super().__init__(params, defaults)
        self.deepspeed = deepspeed
        self._world_from_comm = comm is None and rank is None and world_size is None and group is None
        self.comm = comm
        self.rank = int(rank or 0)
        self.world_size = int(1 if world_size is None else world_size)
        self.dp_group = group
        if self.world_size > 1 and comm is None:
            raise ValueError(f"{self.NAME}: world_size {self.world_size} needs the comm layer (comm=dsplug.comm)")
        self.counters: dict = self.initial_counters()
        #: per param group: this rank's error-feedback buffers
        self.group_buffers: List[Dict[str, torch.Tensor]] = []
        self._compressor = None
        self._native_adam = native_adam_fits(self.param_groups)

    # ------------------------------------------------------------------ the contract
    def initial_counters(self) -> dict:
        return {"step": 0}

    @property
    def distributed(self) -> bool:
        if self._world_from_comm:
            self._bind_comm_world()
        return self.world_size > 1

    def _bind_comm_world(self) -> None:
        """Built without a group: take dsplug's comm world once it is initialized."""
        from dsplug import comm

        if comm.is_initialized():
            self.comm, self.rank, self.world_size = comm, comm.get_rank(), comm.get_world_size()
            self._world_from_comm = False

    @abc.abstractmethod
    def communicates_gradients(self) -> bool:
        """True when the next ``step()`` averages the gradient information over the ranks itself
        (see :class:`dsplug.contracts.Optimizer`); each optimizer answers from its schedule."""

    def ranks_diverge(self) -> bool:
        """True while parameters and ``LOCAL_KEYS`` state differ between ranks."""
        return False

    # ------------------------------------------------------------------ state
    def __setstate__(self, state):
        super().__setstate__(state)
        self._fill_group_defaults()

    def _fill_group_defaults(self) -> None:
        """Loaded groups get the constructor's keys they lack (not torch's own ``differentiable``)."""
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key != "differentiable":
                    group.setdefault(key, value)

    def state_dict(self):
        state = super().state_dict()
        state["onebit"] = {"counters": _copy_plain(self.counters),
                           "groups": [dict(b) for b in self.group_buffers]}
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        for st in self.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = int(st["step"].item())
        self.counters = self.initial_counters()
        self.group_buffers = []
        if extra:
            self.counters.update(_copy_plain(extra.get("counters", {})))
            self._load_group_buffers(extra.get("groups", []))
        else:  # another optimizer's state (AdamW, Lamb): the schedule continues from its step count
            self.counters["step"] = max((int(st.get("step", 0)) for st in self.state.values()), default=0)

    def _load_group_buffers(self, groups) -> None:
        self.group_buffers = []
        for gi, saved in enumerate(groups):
            if gi >= len(self.param_groups):
                break
            params = self.param_groups[gi]["params"]
            device = params[0].device if params else torch.device("cpu")
            self.group_buffers.append({k: v.detach().to(device=device, dtype=torch.float32).clone()
                                       for k, v in saved.items() if torch.is_tensor(v)})

    def rank_state_dict(self) -> dict:
        """This rank's own part of the state: the error-feedback buffers and, while
        :meth:`ranks_diverge`, the ``LOCAL_KEYS`` state of every parameter (by position)."""
        self.distributed  # noqa: B018 -- binds the comm world of an instance built without one
        out = {"world_size": self.world_size, "groups": [dict(b) for b in self.group_buffers]}
        if self.ranks_diverge():
            local = {}
            for index, p in enumerate(p for g in self.param_groups for p in g["params"]):
                st = self.state.get(p)
                if st:
                    local[index] = {k: st[k] for k in self.LOCAL_KEYS if k in st}
            out["params"] = local
        return out

    def load_rank_state_dict(self, saved: dict) -> bool:
        """Take back :meth:`rank_state_dict` (after ``load_state_dict``). False (and the error
        buffers restart from zero) when it was saved at another world size."""
        self.distributed  # noqa: B018 -- binds the comm world of an instance built without one
        if not saved or int(saved.get("world_size", -1)) != self.world_size:
            for buffers in self.group_buffers:
                for t in buffers.values():
                    t.zero_()
            return False
        self._load_group_buffers(saved.get("groups", []))
        params = [p for g in self.param_groups for p in g["params"]]
        for index, values in (saved.get("params") or {}).items():
            st = self.state[params[int(index)]]
            for key, value in values.items():
                st[key] = value.detach().to(device=params[int(index)].device, dtype=params[int(index)].dtype).clone()
        return True

    # ------------------------------------------------------------------ pieces of a step
    def full_group(self, group):
        """Every parameter of ``group`` with its gradient (None if it has none) and its state
        (created: step 0, zero moments)."""
        params, grads, states = [], [], []
        for p in group["params"]:
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g = p.grad
            if g is not None:
                if g.is_sparse:
                    raise RuntimeError(f"{self.NAME} does not support sparse gradients")
                if g.dtype != p.dtype:
                    g = g.to(p.dtype)
            params.append(p)
            grads.append(g)
            states.append(st)
        return params, grads, states

    @staticmethod
    def momentum_update(states, grads, beta1: float, key: str = "exp_avg") -> None:
        """m ← β1·m + (1−β1)·g  (m ← β1·m where a parameter has no gradient)."""
        for st, g in zip(states, grads):
            if g is None:
                st[key].mul_(beta1)
            else:
                st[key].lerp_(g, 1.0 - beta1)

    @staticmethod
    def mask_zero_variance(states, key: str = "exp_avg", variance_key: str = "exp_avg_sq") -> None:
        for st in states:
            st[key].masked_fill_(st[variance_key] == 0, 0)

    @staticmethod
    def ensure_scaling(states, key: str = "exp_avg") -> List[float]:
        if any("scaling_coeff" not in st for st in states):
            for st, s in zip(states, scaling_coefficients([st[key] for st in states])):
                st["scaling_coeff"] = s
        return [st["scaling_coeff"] for st in states]

    def compressed_average_(self, group_index: int, tensors: Sequence[torch.Tensor],
                            scales: Optional[Sequence[float]] = None) -> None:
        """Average ``tensors`` over the ranks in place through the 1-bit compressed all-reduce
        (see the module docstring); a no-op in a world of one. ``scales``: the tensors' scaling
        coefficients (one compression scale for the buffer), or None for a compression scale per
        tensor (no coefficients needed)."""
        if not self.distributed or not tensors:
            return
        per_tensor = scales is None
        if per_tensor:
            scales = [1.0] * len(tensors)
        from .compressed import CompressedAllReduce, padded_numel

        if self._compressor is None:
            self._compressor = CompressedAllReduce(self.comm, self.world_size, self.rank, group=self.dp_group)
        n = sum(t.numel() for t in tensors)
        size = padded_numel(n, self.world_size)
        device = tensors[0].device
        while len(self.group_buffers) <= group_index:
            self.group_buffers.append({})
        buffers = self.group_buffers[group_index]
        worker, server = buffers.get("worker_error"), buffers.get("server_error")
        if worker is None or worker.numel() != size or server is None or server.numel() != size // self.world_size:
            buffers["worker_error"] = torch.zeros(size, dtype=torch.float32, device=device)
            buffers["server_error"] = torch.zeros(size // self.world_size, dtype=torch.float32, device=device)
        flat = torch.zeros(size, dtype=torch.float32, device=device)
        flat[:n].copy_(torch.cat([t.reshape(-1).float() * s if s != 1.0 else t.reshape(-1).float()
                                  for t, s in zip(tensors, scales)]))
        segments = [t.numel() for t in tensors if t.numel()] if per_tensor else None
        self._compressor(flat, buffers["worker_error"], buffers["server_error"], segments=segments)
        offset = 0
        for t, s in zip(tensors, scales):
            piece = flat[offset:offset + t.numel()].view(t.shape)
            t.copy_(piece / s if s != 1.0 else piece)
            offset += t.numel()

    def reset_error_feedback(self) -> None:
        for buffers in self.group_buffers:
            for t in buffers.values():
                t.zero_()

    def adamw_bucket(self, bucket: Bucket, step: int, group: dict) -> None:
        """One AdamW step of ``bucket`` (its gradients all-reduced) with the kernel the ``AdamW``
        optimizer type uses, so the result is bit-identical to it (moments updated too)."""
        hyper = AdamHyper.of({**group, "adam_w_mode": True})
        if self._native_adam:
            op = _cpu_adam_op()
            threads = torch.get_num_threads()
            for p, g, m, v in zip(bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs):
                op.adam_update(p, g, m, v, step=step, lr=group["lr"], beta1=hyper.beta1, beta2=hyper.beta2,
                               eps=group["eps"], weight_decay=group["weight_decay"],
                               bias_correction=hyper.bias_correction, adamw_mode=True, out=None,
                               num_threads=threads)
        elif hyper.bias_correction and fused_kernel_available(bucket.params[0].device, bucket.params[0].dtype):
            fused_adam_step(bucket, step, hyper)
        else:
            foreach_adam_step(bucket, step, hyper)

    @staticmethod
    def adam_apply(params, exp_avgs, exp_avg_sqs, bc1s: Sequence[float], bc2s: Sequence[float], group: dict) -> None:
        """p ← p·(1 − lr·wd);  p ← p − lr · (m / bc1) / (√(v / bc2) + ε)   (moments as they are)."""
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        if not params:
            return
        if wd != 0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [math.sqrt(b) for b in bc2s])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / b for b in bc1s])

    @staticmethod
    def corrections(group: dict, steps: Sequence[int], beta_index: int) -> List[float]:
        """1 − β^k for each k in ``steps`` (1 without bias correction, or for k = 0)."""
        beta = float(group["betas"][beta_index])
        if not group["bias_correction"]:
            return [1.0] * len(steps)
        return [1.0 - beta ** k if k > 0 else 1.0 for k in steps]


def _copy_plain(value):
    if isinstance(value, dict):
        return {k: _copy_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy_plain(v) for v in value]
    return value

