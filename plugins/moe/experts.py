"""The experts of one MoE layer held by this rank (DeepSpeed's ``deepspeed.moe.experts``)."""
from __future__ import annotations

import copy

import torch


class Experts(torch.nn.Module):
    """``num_local_experts`` deep copies of ``expert`` (this rank's share: ``num_experts // ep_size``).

    Every parameter of the copies is marked as DeepSpeed marks expert parameters:
    ``param.allreduce = False`` (not averaged over the whole data-parallel group) and
    ``param.group_name = expert_group_name`` (``"ep_size_<N>"``: averaged over that name's
    expert-data-parallel group instead). The copies start equal (as DeepSpeed's); their gradients
    differ as the gate routes different tokens to them.

    ``forward(inputs)``: ``inputs`` is ``[ep_size, num_local_experts, capacity, d_model]``; local
    expert i receives ``inputs[:, i:i+1]`` (the slots every rank sent it) and the outputs are
    concatenated back along dim 1. An expert returning a tuple contributes its first element.
    """

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1, expert_group_name=None):
        super().__init__()
        if not isinstance(expert, torch.nn.Module):
            raise TypeError(f"Experts: expert must be a torch.nn.Module, got {type(expert).__name__}")
        if int(num_local_experts) < 1:
            raise ValueError(f"Experts: num_local_experts must be >= 1, got {num_local_experts}")
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(int(num_local_experts))])
        self.num_local_experts = int(num_local_experts)
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            outputs.append(out)
        return torch.cat(outputs, dim=1)
