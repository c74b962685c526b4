"""Gating and the sharded MoE layer (DeepSpeed's ``deepspeed.moe.sharded_moe``).

Notation: ``S`` tokens (every leading dimension of the input flattened), ``E`` experts (over all
expert-parallel ranks), ``C`` the capacity (token slots per expert), ``M`` the model width.

A gating function maps the gate's logits ``[S, E]`` to

* ``combine_weights [S, E, C]``: token s goes to slot c of expert e with this weight (0 elsewhere),
* ``dispatch_mask [S, E, C]``: ``combine_weights != 0``,
* ``l_aux``: GShard's load-balancing loss ``E * sum_e me_e * ce_e`` (``me_e`` the mean gate
  probability of expert e, ``ce_e`` the fraction of tokens whose choice is e; for top-k the
  fraction of top-k choices, divided by k). It is 1 for a perfectly balanced router.
* ``exp_counts [E]`` (on the CPU): tokens routed to each expert BEFORE capacity dropping.

Capacity (``drop_tokens=True``): ``C = max(ceil(S / E * capacity_factor * k), min_capacity)``
(k the number of choices per token). Tokens beyond an expert's capacity are dropped: their
output for that expert is 0 (the layer's residual connection carries them in a model).

* top-1: which tokens stay is chosen by Random Token Selection (``use_rts``: each routed token
  draws u ~ U(0, 1); the C largest stay), else by position (the first C in token order).
* top-2: position: all first choices rank before all second choices; the two kept gates are
  renormalised to sum to 1. With ``top2_2nd_expert_sampling`` the 2nd expert is chosen by the
  Gumbel-max trick on the logits (a sample, not the argmax).
* top-k (k > 2): ``drop_policy="probs"`` keeps the C tokens with the largest gate for each
  expert, ``"position"`` the first C; kept gates renormalised per token.

``drop_tokens=False``: ``C`` is the largest expert count, agreed over the expert-parallel group
(an all-reduce MAX), so nothing is dropped and every rank sends equal-sized messages.

Noise (training only): ``noisy_gate_policy="Jitter"`` multiplies the gate's input by
u ~ U(1 - 1e-2, 1 + 1e-2) elementwise; ``"RSample"`` (top-1) adds Gumbel(0, 1) noise to the
logits for choosing the expert (the gate values stay the clean softmax).

:class:`MOELayer` dispatches ``[E, C, M]`` slots, exchanges them by all-to-all over the
expert-parallel group (each rank receives the slots of its own ``E / ep_size`` experts from every
rank), runs its local experts, exchanges back and combines.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from dsplug import comm

#: DeepSpeed's noisy_gate_policy values (None and the string 'None' mean no noise)
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")
TUTEL_UNAVAILABLE = ("use_tutel=True: Tutel's fused MoE kernels are not available in dsplug; the gating, dispatch "
                     "and combine run in plain PyTorch (pass use_tutel=False)")


# ------------------------------------------------------------------ noise
def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """``x * u`` with u ~ U(1 - epsilon, 1 + epsilon) elementwise (Switch Transformer's jitter)."""
    if epsilon == 0:
        return x
    u = torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * u


def gumbel_rsample(shape, device=None) -> torch.Tensor:
    """Gumbel(0, 1) samples: ``-log(-log(u))`` with u ~ U(0, 1)."""
    u = torch.rand(shape, device=device).clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


# ------------------------------------------------------------------ helpers
def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """``max(ceil(S / E * capacity_factor), min_capacity)``."""
    return max(int(math.ceil(num_tokens / num_experts * float(capacity_factor))), int(min_capacity))


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    return F.one_hot(index.long(), num_classes=num_classes)


def _agreed_capacity(exp_counts: torch.Tensor, device, ep_group) -> int:
    """``drop_tokens=False``: the largest expert count, as the MAX over the expert-parallel group."""
    largest = torch.tensor([int(exp_counts.max())], dtype=torch.int64, device=device)
    if comm.is_initialized():
        comm.all_reduce(largest, op=comm.ReduceOp.MAX, group=ep_group)
    return max(int(largest.item()), 1)


def _keep_top(mask: torch.Tensor, scores: torch.Tensor, capacity: int) -> torch.Tensor:
    """Per expert (column), keep at most ``capacity`` of the routed tokens (mask 1): the ones with
    the largest ``scores`` (unrouted tokens score below every routed one)."""
    k = min(capacity, mask.shape[0])
    ranked = torch.where(mask.bool(), scores, torch.full_like(scores, float("-inf")))
    top = torch.topk(ranked, k=k, dim=0).indices
    keep = torch.zeros_like(mask).scatter_(0, top, 1)
    return mask * keep


def _check_common(logits: torch.Tensor, capacity_factor, min_capacity) -> None:
    if logits.dim() != 2:
        raise ValueError(f"gating: logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if float(capacity_factor) <= 0:
        raise ValueError(f"gating: capacity_factor must be > 0, got {capacity_factor}")
    if int(min_capacity) < 0:
        raise ValueError(f"gating: min_capacity must be >= 0, got {min_capacity}")


# ------------------------------------------------------------------ gating functions
def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group=None, use_tutel: bool = False):
    """Top-1 gating: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (see the module docstring)."""
    if use_tutel:
        raise ValueError(TUTEL_UNAVAILABLE)
    _check_common(logits, capacity_factor, min_capacity)
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: valid values are None, 'Jitter', 'RSample'")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choose_from = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask1 = _one_hot(torch.argmax(choose_from, dim=1), num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
    exp_counts = mask1.sum(dim=0).detach().to("cpu")

    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
        if use_rts:
            scores = torch.rand(mask1.shape, device=logits.device)
        else:  # earlier tokens first
            scores = -torch.arange(num_tokens, device=logits.device, dtype=torch.float32).unsqueeze(1) \
                .expand(num_tokens, num_experts)
        mask1 = _keep_top(mask1, scores, capacity)
    else:
        capacity = _agreed_capacity(exp_counts, logits.device, ep_group)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.to(gates.dtype)
    locations1_sc = _one_hot(locations1_s, capacity).to(gates.dtype)
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True):
    """Top-2 gating: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (see the module docstring)."""
    _check_common(logits, capacity_factor, min_capacity)
    num_tokens, num_experts = logits.shape
    if num_experts < 2:
        raise ValueError(f"top-2 gating needs at least 2 experts, got {num_experts}")
    gates = F.softmax(logits, dim=1)
    mask1 = _one_hot(torch.argmax(gates, dim=1), num_experts)
    second_from = logits + gumbel_rsample(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    second_from = second_from.masked_fill(mask1.bool(), float("-inf"))
    mask2 = _one_hot(torch.argmax(second_from, dim=1), num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # after every first choice

    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to("cpu")

    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    else:
        capacity = _agreed_capacity(exp_counts, logits.device, ep_group)

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.to(gates.dtype), mask2.to(gates.dtype)
    gates1_s = (gates * mask1_float).sum(dim=1)
    gates2_s = (gates * mask2_float).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1 = (gates1_s / denom_s).unsqueeze(1) * mask1_float
    gates2 = (gates2_s / denom_s).unsqueeze(1) * mask2_float
    combine_weights = torch.einsum("se,sc->sec", gates1, _one_hot(locations1_s, capacity).to(gates.dtype)) + \
        torch.einsum("se,sc->sec", gates2, _one_hot(locations2_s, capacity).to(gates.dtype))
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs"):
    """Top-k gating: ``(l_aux, combine_weights, dispatch_mask, exp_counts)`` (see the module docstring)."""
    _check_common(logits, capacity_factor, min_capacity)
    num_tokens, num_experts = logits.shape
    if not 1 <= int(k) <= num_experts:
        raise ValueError(f"top-k gating: k={k} must be between 1 and the number of experts ({num_experts})")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"top-k gating: drop_policy={drop_policy!r}: valid values are {', '.join(DROP_POLICIES)}")
    k = int(k)
    gates = F.softmax(logits, dim=1)
    topk_gates, topk_indices = torch.topk(gates, k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.int64).scatter_(1, topk_indices, 1)
    exp_counts = mask.sum(dim=0).detach().to("cpu")

    me = gates.mean(dim=0)
    ce = mask.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k

    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            mask = _keep_top(mask, gates.detach().float(), capacity)
        else:
            mask = mask * ((torch.cumsum(mask, dim=0) - 1) < capacity)
    else:
        capacity = _agreed_capacity(exp_counts, logits.device, ep_group)

    locations = torch.cumsum(mask, dim=0) - 1
    gates_masked = gates * mask.to(gates.dtype)
    denom_s = torch.clamp(gates_masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    gates_masked = gates_masked / denom_s
    locations_sc = _one_hot(locations * mask, capacity).to(gates.dtype)
    combine_weights = torch.einsum("se,sec->sec", gates_masked, locations_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


# ------------------------------------------------------------------ the gate
class TopKGate(torch.nn.Module):
    """The router: an fp32 linear map ``[M] -> [E]`` (no bias; ``wg``) and a gating function.

    The logits are computed in fp32 whatever the model's dtype (the weight is read as fp32 in
    forward, so a model cast to bf16 keeps its parameter objects). ``capacity_factor`` applies
    in training, ``eval_capacity_factor`` in eval; noise only in training.
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None, top2_2nd_expert_sampling: bool = True,
                 drop_policy: str = "probs"):
        super().__init__()
        if int(num_experts) < 1:
            raise ValueError(f"TopKGate: num_experts must be >= 1, got {num_experts}")
        if not 1 <= int(k) <= int(num_experts):
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts ({num_experts})")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"TopKGate: noisy_gate_policy={noisy_gate_policy!r}: valid values are None, 'Jitter', "
                             "'RSample'")
        if noisy_gate_policy == "RSample" and int(k) != 1:
            raise ValueError(f"TopKGate: noisy_gate_policy='RSample' applies to top-1 gating only (k={k}); use "
                             "'Jitter' or None")
        for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if float(value) <= 0:
                raise ValueError(f"TopKGate: {name} must be > 0, got {value}")
        if int(min_capacity) < 0:
            raise ValueError(f"TopKGate: min_capacity must be >= 0, got {min_capacity}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"TopKGate: drop_policy={drop_policy!r}: valid values are {', '.join(DROP_POLICIES)}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = int(k)
        self.num_experts = int(num_experts)
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
        self.min_capacity = int(min_capacity)
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = bool(drop_tokens)
        self.use_rts = bool(use_rts)
        self.ep_group = ep_group
        self.top2_2nd_expert_sampling = bool(top2_2nd_expert_sampling)
        self.drop_policy = drop_policy

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def logits(self, input: torch.Tensor) -> torch.Tensor:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        return F.linear(x, self.wg.weight.float())

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None, use_tutel: bool = False):
        if use_tutel:
            raise ValueError(TUTEL_UNAVAILABLE)
        logits = self.logits(input)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group)
        if used_token is not None:
            raise ValueError(f"TopKGate: used_token applies to top-1 gating only (k={self.k})")
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          self.drop_policy)


# ------------------------------------------------------------------ all-to-all with autograd
class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 over ``group`` through :func:`dsplug.comm.all_to_all_single` (the
    comms logger sees it); its gradient is the same exchange of the output gradient."""

    @staticmethod
    def forward(ctx, group, input: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        comm.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return None, _AllToAll.apply(ctx.group, grad_output)


def all_to_all(group, input: torch.Tensor) -> torch.Tensor:
    """Differentiable all-to-all of ``input``'s dim-0 chunks over ``group``."""
    return _AllToAll.apply(group, input)


# ------------------------------------------------------------------ the layer
class MOELayer(torch.nn.Module):
    """Gate -> dispatch -> all-to-all -> local experts -> all-to-all -> combine.

    ``forward(hidden, used_token=None)`` returns the combined output (the input's shape) and
    leaves ``l_aux`` and ``exp_counts`` on the layer. The expert-parallel group ``ep_group_name``
    (``"ep_size_<ep_size>"``) is created on first use if nobody set it (``_set_ep_group`` or the
    owning :class:`dsplug.moe.layer.MoE`'s ``set_deepspeed_parallelism``).
    """

    def __init__(self, gate: TopKGate, experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False):
        super().__init__()
        if use_tutel:
            raise ValueError(TUTEL_UNAVAILABLE)
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = int(ep_size)
        self.num_local_experts = int(num_local_experts)
        self.ep_group = None
        self._ep_group_set = False
        self.use_tutel = False
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)
        self._ep_group_set = True

    def ensure_ep_group(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (if needed) and adopt the ``ep_size_<N>`` groups (every rank calls it alike)."""
        if self._ep_group_set:
            return
        from . import groups

        if self.ep_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self._set_ep_group(groups._get_expert_parallel_group(self.ep_group_name))

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        self.ensure_ep_group()
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        l_aux, combine_weights, dispatch_mask, exp_counts = self.gate(tokens, used_token)
        # [S, E, C] x [S, M] -> [E, C, M]: slot c of expert e holds its token (zeros where empty)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.to(tokens.dtype), tokens)
        if self.ep_size > 1:
            dispatched = all_to_all(self.ep_group, dispatched)  # now: this rank's experts' slots from every rank
        capacity = dispatched.shape[1]
        expert_output = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, capacity, d_model))
        if self.ep_size > 1:
            expert_output = all_to_all(self.ep_group, expert_output.contiguous())
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, capacity, d_model)
        combined = torch.einsum("sec,ecm->sm", combine_weights.to(tokens.dtype), expert_output)
        self.l_aux = l_aux
        self.exp_counts = exp_counts
        return combined.reshape(hidden.shape)


__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "multiplicative_jitter",
           "gumbel_rsample", "NOISY_GATE_POLICIES"]
