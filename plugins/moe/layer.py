"""DeepSpeed's ``deepspeed.moe.layer.MoE``: a mixture-of-experts layer for a transformer block.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` replaces a dense FFN ``expert`` by
``num_experts`` copies of it and a router; ``forward(hidden_states, used_token=None)`` returns
``(output, l_aux, exp_counts)``: the output has the input's shape, ``l_aux`` is the
load-balancing loss to add to the model's loss (scaled by a coefficient, e.g. 0.01) and
``exp_counts`` the tokens routed to each expert (before capacity dropping).

Expert parallelism: the experts are sharded over ``ep_size`` ranks of the data-parallel group
(``num_experts // ep_size`` on each); tokens go to the rank of their expert and back by
all-to-all. The ``"ep_size_<N>"`` process groups (:mod:`.groups`, ``dsplug.utils.groups``) are created on the
first forward, or explicitly by :meth:`MoE.set_deepspeed_parallelism` (every rank alike).

PR-MoE (``use_residual=True``, the DeepSpeed-MoE paper's Residual-MoE): a dense copy of the
expert runs on every token and a 2-way coefficient layer mixes the two::

    c = softmax(coefficient(x))                 # [..., 2]
    output = moe(x) * c[..., 0:1] + mlp(x) * c[..., 1:2]
"""
from __future__ import annotations

from typing import Optional

import torch

from .experts import Experts
from .sharded_moe import MOELayer, NOISY_GATE_POLICIES, TUTEL_UNAVAILABLE, TopKGate


class MoE(torch.nn.Module):
    """A mixture-of-experts layer (see the module docstring).

    Arguments (DeepSpeed's): ``hidden_size`` (the model width M), ``expert`` (a module mapping
    ``[..., M] -> [..., M]``), ``num_experts`` (over all ranks), ``ep_size`` (expert-parallel
    ranks; must divide ``num_experts`` and the data-parallel world size), ``k`` (experts per
    token), ``capacity_factor`` / ``eval_capacity_factor`` (training / eval capacity multiplier),
    ``min_capacity``, ``use_residual`` (PR-MoE), ``noisy_gate_policy`` (None, 'Jitter',
    'RSample'), ``drop_tokens``, ``use_rts`` (random token selection, top-1), ``use_tutel``
    (not available: an error), ``enable_expert_tensor_parallelism`` (needs a model-parallel unit;
    see :meth:`set_deepspeed_parallelism`), ``top2_2nd_expert_sampling``.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if use_tutel:
            raise ValueError("MoE: " + TUTEL_UNAVAILABLE)
        for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("ep_size", ep_size),
                            ("k", k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive integer, got {value!r}")
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size}): each "
                             f"expert-parallel rank holds num_experts // ep_size experts")
        if k > num_experts:
            raise ValueError(f"MoE: k ({k}) must not exceed num_experts ({num_experts})")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r}: valid values are None, 'Jitter', "
                             "'RSample'")
        self.use_residual = bool(use_residual)
        self.enable_expert_tensor_parallelism = bool(enable_expert_tensor_parallelism)
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.k = k

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, self.ep_size, self.num_local_experts)
        if self.use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create this layer's expert-parallel and expert-data-parallel groups (``"ep_size_<N>"``,
        inside the data-parallel group) if they do not exist, and route through them. A collective:
        every rank calls it in the same order (the first forward does when nobody did)."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        from . import groups

        if self.enable_expert_tensor_parallelism and groups._get_model_parallel_world_size() > 1:
            raise ValueError("MoE: enable_expert_tensor_parallelism=True with a model-parallel unit is not available "
                             "in dsplug (experts are not sliced over tensor-parallel ranks); pass "
                             "enable_expert_tensor_parallelism=False")
        self.deepspeed_moe._ep_group_set = False
        self.deepspeed_moe.ensure_ep_group(use_data_before_expert_parallel_)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        if not self.deepspeed_moe._ep_group_set:
            self._create_process_groups()
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
