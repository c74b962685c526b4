"""0/1 Adam (Lu et al., 2022, "Maximizing Communication Efficiency for Large-scale Training via
0/1 Adam"): ``"optimizer": {"type": "ZeroOneAdam"}``.

t is the optimizer step (1-based; overflow-skipped steps do not count), W the data-parallel world
size, k a parameter's number of variance updates so far, corrections 1 without
``bias_correction``. Counters (rank-invariant, checkpointed): ``var_interval`` I_v = 1,
``var_counter`` = 0, ``local_interval`` I_l = 1, ``local_counter`` = 0, ``since_sync`` = 0.

**Variance phase, t ≤ var_freeze_step.**

* t is a *variance step* when t mod I_v = 0. The ZeRO stage all-reduces the gradients in full
  precision (``communicates_gradients()`` is False) and the step is Adam's::

      m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g² ;  k ← k + 1
      p ← p·(1 − lr·wd) ;    p ← p − lr · (m / (1−β1^t)) / (√(v / (1−β2^k)) + ε)

  While k = t (every step so far was a variance step: the first ``var_update_scaler`` steps) it
  runs through the ``AdamW`` optimizer type's kernel, so it is bit-identical to ``AdamW``.
  Afterwards: var_counter += 1; when var_counter = ``var_update_scaler``: var_counter = 0 and
  I_v ← 2·I_v. So the variance steps are 1, 2, ..., S, then every 2nd step S times, every 4th
  step S times, ... (S = var_update_scaler).
* Any other step (W > 1: ``communicates_gradients()`` is True, g LOCAL)::

      m ← β1·m + (1−β1)·g_local ;  m ← CompressedAllReduce(m) ;  m ← 0 where v = 0
      p ← p·(1 − lr·wd) ;          p ← p − lr · (m / (1−β1^t)) / (√(v / (1−β2^k)) + ε)

  This is the paper's 1-bit synchronisation (Algorithm 1 averages u = Σ lr·m in 1 bit at every
  synchronisation step; with a synchronisation every step that is lr·m, i.e. the momentum).
  DeepSpeed's implementation instead compresses the *gradient* on these steps and updates m
  with it (m ← β1·m + (1−β1)·C(g)); both keep m identical on every rank and send the same bytes.

**Local-step phase, t > var_freeze_step** (v frozen; ``communicates_gradients()`` True). A
*window* starts with the synchronised parameters: anchor a ← p, accumulator u ← 0, Λ ← 0 (sum of
lr), D ← 1 (product of decay factors). Each step, without communication::

    m ← β1·m + (1−β1)·g_local ;  m ← 0 where v = 0 ;  m̂ = m / (1−β1^t)
    p ← p·(1 − lr·wd) ;          p ← p − lr · m̂ / (√(v / (1−β2^k)) + ε)
    u ← u + lr·m̂ ;  Λ ← Λ + lr ;  D ← D·(1 − lr·wd) ;  since_sync += 1

When since_sync ≥ I_l, the window ends with a synchronisation (identical result on every rank)::

    u ← CompressedAllReduce(u) ;  u ← 0 where v = 0
    p ← D·a − u / (√(v / (1−β2^k)) + ε)
    m ← (1−β1^t) · u / Λ        (the lr-weighted average momentum; Λ = 0: m ← CompressedAllReduce(m))
    since_sync ← 0

Then local_counter += 1; when local_counter = ``local_step_scaler``: local_counter = 0 and
I_l ← min(2·I_l, ``local_step_clipper``). The error-feedback buffers restart from zero when the
local-step phase begins. Between synchronisations parameters, m and u differ between ranks
(``ranks_diverge()``; the plugin checkpoints them per rank).

**CompressedAllReduce here compresses each tensor with its own scale** (a worker scale per
tensor, a server scale per (tensor, server chunk) piece; :class:`.compressed.CompressedAllReduce`
with ``segments``), as DeepSpeed compresses each tensor separately. (Until this was fixed the
whole param group shared one scale, the tensors weighted by scaling coefficients fixed at the
first compressed step, t = ``var_update_scaler`` + 1, early in the lr warm-up: a tensor whose
momentum later became small relative to the others was synchronised as noise the size of the
others -- a relative error of 8e6 in ``test_zero_one_adam_compresses_each_tensor_with_its_own_scale``.
On the char-LM benchmark with var_freeze_step at 50 % of the run it moved 0/1 Adam from +5.7 /
+12.2 / -5.5 % to -12.0 / +1.5 / -16.9 % held-out loss vs AdamW over three seeds; see
docs/onebit.md.)

With W = 1 nothing is communicated: non-variance steps use the stale variance, and the local
phase is Adam with the frozen variance (no anchor, accumulator or synchronisation).

Compared with DeepSpeed's ``ZeroOneAdam``: DeepSpeed applies no bias correction, compresses the
gradient on the non-variance steps before var_freeze_step (see above), puts the weight decay
into u instead of D, and keeps its schedule counters per parameter (it synchronises when the
global step is a multiple of I_l; here after I_l local steps); the synchronisation above is the
paper's (x ← x_anchor − u / √v, m ← u / Σlr) with decoupled weight decay folded in through D.
Gradient clipping during the local-step phase (and on the compressed steps) clips each rank's
LOCAL gradient by its own norm, as in DeepSpeed (there is no averaged gradient to clip).
"""
from __future__ import annotations

import torch

from dsplug.ops.multi_tensor import adam_buckets, update_moments

from .common import OneBitOptimizer, check_deepspeed_arguments


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam, with DeepSpeed's ``ZeroOneAdam`` signature and defaults (``deepspeed=None,
    lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
    weight_decay=0, max_grad_norm=0, var_freeze_step=100000, var_update_scaler=16,
    local_step_scaler=32678, local_step_clipper=16, amsgrad=False, cuda_aware=False,
    comm_backend_name='nccl'``; see :data:`.common.INERT_ARGUMENTS`) plus the keyword-only
    ``comm`` / ``rank`` / ``world_size`` / ``group`` (see :class:`.common.OneBitOptimizer`)."""

    NAME = "ZeroOneAdam"
    LOCAL_KEYS = ("exp_avg", "momentum_accumulator")

    def __init__(self, params, deepspeed=None, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", *, comm=None, rank=None,
                 world_size=None, group=None):
        check_deepspeed_arguments(self.NAME, amsgrad, eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm,
                                  cuda_aware=cuda_aware, comm_backend_name=comm_backend_name)
        for name, value, low in (("var_freeze_step", var_freeze_step, 0), ("var_update_scaler", var_update_scaler, 1),
                                 ("local_step_scaler", local_step_scaler, 1),
                                 ("local_step_clipper", local_step_clipper, 1)):
            if int(value) < low:
                raise ValueError(f"{self.NAME}: {name} must be >= {low}, got {value!r}")
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, comm=comm, rank=rank, world_size=world_size, group=group,
                         deepspeed=deepspeed)

    def initial_counters(self) -> dict:
        return {"step": 0, "var_interval": 1, "var_counter": 0, "local_interval": 1, "local_counter": 0,
                "since_sync": 0, "local_started": False, "windows": []}

    # ------------------------------------------------------------------ schedule
    def variance_step(self, step: int) -> bool:
        return step <= self.var_freeze_step and step % self.counters["var_interval"] == 0

    def communicates_gradients(self) -> bool:
        return self.distributed and not self.variance_step(self.counters["step"] + 1)

    def ranks_diverge(self) -> bool:
        return self.distributed and self.counters["since_sync"] > 0

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        c = self.counters
        t = c["step"] + 1
        if t <= self.var_freeze_step:
            variance = self.variance_step(t)
            for gi, group in enumerate(self.param_groups):
                if variance:
                    self._variance_step(group)
                else:
                    self._compressed_step(gi, group)
            if variance:
                c["var_counter"] += 1
                if c["var_counter"] == self.var_update_scaler:
                    c["var_counter"] = 0
                    c["var_interval"] *= 2
        else:
            if not c["local_started"]:
                self.reset_error_feedback()
                c["local_started"] = True
            for gi, group in enumerate(self.param_groups):
                self._local_step(gi, group)
            c["since_sync"] += 1
            if c["since_sync"] >= c["local_interval"]:
                for gi, group in enumerate(self.param_groups):
                    self._synchronise(gi, group)
                c["since_sync"] = 0
            c["local_counter"] += 1
            if c["local_counter"] == self.local_step_scaler:
                c["local_counter"] = 0
                c["local_interval"] = min(2 * c["local_interval"], self.local_step_clipper)
        c["step"] = t
        return loss

    def _variance_step(self, group: dict) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        for (_device, _dtype, taken), bucket in adam_buckets(self, group, self.NAME).items():
            step = taken + 1
            if all(st.get("var_step", 0) == taken for st in bucket.states):
                self.adamw_bucket(bucket, step, group)  # every step so far was a variance step: AdamW's kernel
            else:
                update_moments(bucket, bucket.grads, beta1, beta2)
                var_steps = [st.get("var_step", 0) + 1 for st in bucket.states]
                self.adam_apply(bucket.params, bucket.exp_avgs, bucket.exp_avg_sqs,
                                self.corrections(group, [step] * len(bucket.params), 0),
                                self.corrections(group, var_steps, 1), group)
            for st in bucket.states:
                st["var_step"] = st.get("var_step", 0) + 1
            bucket.advance(step)

    def _prepare(self, group):
        params, grads, states = self.full_group(group)
        for st in states:
            st.setdefault("var_step", 0)
        return params, grads, states

    def _compressed_step(self, gi: int, group: dict) -> None:
        params, grads, states = self._prepare(group)
        if not params:
            return
        self.momentum_update(states, grads, float(group["betas"][0]))
        self.compressed_average_(gi, [st["exp_avg"] for st in states])  # a scale per tensor
        self.mask_zero_variance(states)
        for st in states:
            st["step"] += 1
        self._apply(params, states, group)

    def _apply(self, params, states, group) -> None:
        self.adam_apply(params, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                        self.corrections(group, [st["step"] for st in states], 0),
                        self.corrections(group, [st["var_step"] for st in states], 1), group)

    def _window(self, gi: int) -> dict:
        windows = self.counters["windows"]
        while len(windows) <= gi:
            windows.append({"lr_sum": 0.0, "decay": 1.0})
        return windows[gi]

    def _local_step(self, gi: int, group: dict) -> None:
        params, grads, states = self._prepare(group)
        if not params:
            return
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if self.distributed:
            if self.counters["since_sync"] == 0:  # a window starts at the synchronised parameters
                for p, st in zip(params, states):
                    if "anchor" in st:
                        st["anchor"].copy_(p)
                    else:
                        st["anchor"] = p.detach().clone()
                    if "momentum_accumulator" in st:
                        st["momentum_accumulator"].zero_()
                    else:
                        st["momentum_accumulator"] = torch.zeros_like(p)
                window = self._window(gi)
                window["lr_sum"], window["decay"] = 0.0, 1.0
        self.momentum_update(states, grads, float(group["betas"][0]))
        self.mask_zero_variance(states)
        for st in states:
            st["step"] += 1
        self._apply(params, states, group)
        if self.distributed:
            bc1s = self.corrections(group, [st["step"] for st in states], 0)
            for st, bc1 in zip(states, bc1s):
                st["momentum_accumulator"].add_(st["exp_avg"], alpha=lr / bc1)
            window = self._window(gi)
            window["lr_sum"] += lr
            window["decay"] *= 1.0 - lr * wd

    def _synchronise(self, gi: int, group: dict) -> None:
        if not self.distributed:
            return
        params, _grads, states = self._prepare(group)
        if not params:
            return
        window = self._window(gi)
        accumulators = [st["momentum_accumulator"] for st in states]
        self.compressed_average_(gi, accumulators)  # a scale per tensor
        self.mask_zero_variance(states, key="momentum_accumulator")
        eps = float(group["eps"])
        bc1s = self.corrections(group, [st["step"] for st in states], 0)
        bc2s = self.corrections(group, [st["var_step"] for st in states], 1)
        for p, st, bc2 in zip(params, states, bc2s):
            denom = st["exp_avg_sq"].sqrt().div_(bc2 ** 0.5).add_(eps)
            p.copy_(st["anchor"]).mul_(window["decay"]).addcdiv_(st["momentum_accumulator"], denom, value=-1.0)
        if window["lr_sum"] > 0:
            for st, bc1 in zip(states, bc1s):
                st["exp_avg"].copy_(st["momentum_accumulator"]).mul_(bc1 / window["lr_sum"])
        else:
            self.compressed_average_(gi, [st["exp_avg"] for st in states])
            self.mask_zero_variance(states)
        for st in states:
            st["momentum_accumulator"].zero_()
        window["lr_sum"], window["decay"] = 0.0, 1.0
