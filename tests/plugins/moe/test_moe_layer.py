"""The MoE layer in one process: equal to a dense FFN with one expert, equal to a token-by-token
reference with several (outputs and gradients), PR-MoE, the expert parameter marks, optimizer
groups and DeepSpeed's import paths."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from dsplug.moe.layer import MoE
from dsplug.moe.utils import (has_moe_layers, is_moe_param, split_params_into_different_moe_groups_for_optimizer,
                              split_params_into_shared_and_expert_params)


def ffn(d=8, h=16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d))


def randomize_experts(moe: MoE, seed: int = 1) -> None:
    """Experts start as equal copies (as DeepSpeed's): give each its own weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        moe.deepspeed_moe.gate.wg.weight.copy_(torch.randn(moe.deepspeed_moe.gate.wg.weight.shape, generator=g))


@pytest.mark.parametrize("drop_tokens", [True, False])
def test_one_expert_equals_the_dense_ffn(drop_tokens):
    dense = ffn()
    moe = MoE(8, ffn(), num_experts=1, k=1, capacity_factor=1.0, min_capacity=0, drop_tokens=drop_tokens)
    moe.deepspeed_moe.experts.deepspeed_experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 5, 8)
    x_dense = x.clone().requires_grad_(True)
    x_moe = x.clone().requires_grad_(True)
    target = torch.randn(3, 5, 8)
    out_dense = dense(x_dense)
    out_moe, l_aux, counts = moe(x_moe)
    torch.testing.assert_close(out_moe, out_dense, rtol=0, atol=1e-6)
    assert counts.tolist() == [15] and float(l_aux.detach()) == pytest.approx(1.0)
    ((out_dense - target) ** 2).mean().backward()
    ((out_moe - target) ** 2).mean().backward()
    expert = moe.deepspeed_moe.experts.deepspeed_experts[0]
    for (name, p_dense), p_moe in zip(dense.named_parameters(), expert.parameters()):
        torch.testing.assert_close(p_moe.grad, p_dense.grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(x_moe.grad, x_dense.grad, rtol=1e-5, atol=1e-7)
    # one expert: the gate's softmax is constant 1, so the router gets no gradient from the output
    assert float(moe.deepspeed_moe.gate.wg.weight.grad.abs().max()) == 0.0


def reference_forward(moe: MoE, x: torch.Tensor):
    """Token by token: output[s] = sum over the experts e that kept s of w[s, e] * expert_e(x[s]),
    with w taken from an independent top-k + capacity computation (position policy, no noise)."""
    layer = moe.deepspeed_moe
    gate = layer.gate
    tokens = x.reshape(-1, x.shape[-1])
    S, E, k = tokens.shape[0], moe.num_experts, moe.k
    gates = torch.softmax(tokens.float() @ gate.wg.weight.t(), dim=1)
    capacity = max(int(-(-S * gate.capacity_factor * k // E)), gate.min_capacity)
    order = [torch.topk(gates[s], k).indices.tolist() for s in range(S)]
    filled = [0] * E
    kept = [[False] * k for _ in range(S)]
    for j in range(k):  # choices rank by round (all first choices, then second), then by token
        for s in range(S):
            e = order[s][j]
            if filled[e] < capacity:
                filled[e] += 1
                kept[s][j] = True
    outputs = []
    for s in range(S):
        total = sum(gates[s, order[s][j]] for j in range(k) if kept[s][j])
        out = torch.zeros_like(tokens[s])
        for j in range(k):
            if kept[s][j]:
                e = order[s][j]
                w = gates[s, e] / total if k > 1 else gates[s, e]
                out = out + w * layer.experts.deepspeed_experts[e](tokens[s])
        outputs.append(out)
    return torch.stack(outputs).reshape(x.shape)


@pytest.mark.parametrize("k,capacity_factor", [(1, 1.0), (1, 0.5), (2, 0.75), (2, 4.0)])
def test_several_experts_equal_the_token_by_token_reference(k, capacity_factor):
    moe = MoE(8, ffn(), num_experts=4, k=k, capacity_factor=capacity_factor, min_capacity=0, use_rts=False,
              top2_2nd_expert_sampling=False)
    randomize_experts(moe)
    x = torch.randn(2, 12, 8)
    target = torch.randn(2, 12, 8)
    out, l_aux, counts = moe(x)
    ref = reference_forward(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    params = list(moe.parameters())
    grads = torch.autograd.grad(((out - target) ** 2).sum(), params)
    ref_grads = torch.autograd.grad(((ref - target) ** 2).sum(), params, allow_unused=True)
    for p, g, r in zip(params, grads, ref_grads):
        torch.testing.assert_close(g, torch.zeros_like(p) if r is None else r, rtol=1e-4, atol=1e-6)
    assert int(counts.sum()) == 24 * k


def test_pr_moe_mixes_the_experts_and_the_dense_mlp_by_a_learned_coefficient():
    mlp = ffn(seed=3)
    moe = MoE(8, mlp, num_experts=2, k=1, use_residual=True, capacity_factor=2.0, use_rts=False)
    randomize_experts(moe, seed=4)
    assert moe.mlp is mlp and isinstance(moe.coefficient, torch.nn.Linear) and moe.coefficient.out_features == 2
    assert not any(is_moe_param(p) for p in mlp.parameters())  # the dense branch is averaged like any layer
    x = torch.randn(4, 3, 8)
    out, _, _ = moe(x)
    expert_out = moe.deepspeed_moe(x)
    c = torch.softmax(x @ moe.coefficient.weight.t() + moe.coefficient.bias, dim=-1)
    torch.testing.assert_close(out, expert_out * c[..., :1] + mlp(x) * c[..., 1:], rtol=1e-6, atol=1e-6)


def test_expert_parameters_carry_deepspeeds_marks_and_local_count():
    moe = MoE(8, ffn(), num_experts=4, ep_size=1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == 4 and moe.num_local_experts == 4 and moe.expert_group_name == "ep_size_1"
    for p in experts.parameters():
        assert p.allreduce is False and p.group_name == "ep_size_1" and is_moe_param(p)
    assert not is_moe_param(moe.deepspeed_moe.gate.wg.weight)
    names = [n for n, _ in moe.named_parameters()]
    assert "deepspeed_moe.experts.deepspeed_experts.3.2.weight" in names and "deepspeed_moe.gate.wg.weight" in names
    assert has_moe_layers(torch.nn.Sequential(moe)) == (True, 4)
    assert has_moe_layers(ffn()) == (False, 0)
    shared, expert = split_params_into_shared_and_expert_params(moe.parameters())
    assert len(shared) == 1 and len(expert) == 16


def test_split_params_into_moe_groups_for_optimizer():
    moe = MoE(8, ffn(), num_experts=2)
    dense = torch.nn.Linear(8, 8)
    params = list(dense.parameters()) + list(moe.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": iter(params), "name": "parameters", "lr": 0.1, "weight_decay": 0.01})
    assert isinstance(groups, tuple) and len(groups) == 2
    assert groups[0]["name"] == "parameters" and groups[0]["lr"] == 0.1 and "moe" not in groups[0]
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in params if not is_moe_param(p)]
    assert groups[1] == {"name": "ep_size_1", "moe": True, "lr": 0.1, "weight_decay": 0.01,
                         "params": groups[1]["params"]}
    assert [id(p) for p in groups[1]["params"]] == [id(p) for p in params if is_moe_param(p)]
    torch.optim.AdamW(groups)  # a valid set of optimizer groups

    # a cap on elements per group: expert params (8*16 + 16 + 16*8 + 8 = 280 per expert) split in order
    sizes = [p.numel() for p in params if is_moe_param(p)]
    capped = split_params_into_different_moe_groups_for_optimizer([{"params": params, "name": "p"}],
                                                                  max_group_size=300)
    chunks = [[p.numel() for p in g["params"]] for g in capped[1:]]
    assert sum(chunks, []) == sizes and all(sum(c) <= 300 or len(c) == 1 for c in chunks)
    assert len(chunks) == 2


def test_split_params_rejects_what_is_not_a_param_group():
    with pytest.raises(ValueError, match="param_groups must be a dict, a list or a tuple"):
        split_params_into_different_moe_groups_for_optimizer(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match=r"param_groups\[0\] must be a dict with a 'params' key"):
        split_params_into_different_moe_groups_for_optimizer([[torch.nn.Parameter(torch.zeros(1))]])


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_experts=3, ep_size=2), r"num_experts \(3\) must be divisible by ep_size \(2\)"),
    (dict(num_experts=2, k=3), r"k \(3\) must not exceed num_experts \(2\)"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
    (dict(noisy_gate_policy="Gaussian"), "noisy_gate_policy='Gaussian'"),
    (dict(use_tutel=True), "Tutel.*not available in dsplug"),
])
def test_moe_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(8, ffn(), **kwargs)


def test_ep_size_larger_than_the_world_is_an_error_naming_both():
    moe = MoE(8, ffn(), num_experts=2, ep_size=2)
    with pytest.raises(ValueError, match="expert parallel size 2 must divide the data-parallel world size 1"):
        moe(torch.randn(4, 8))


def test_deepspeed_import_paths():
    from dsplug.plugins.deepspeed_alias import finder

    assert "deepspeed" not in sys.modules
    try:
        finder.install()
        import deepspeed.moe.layer
        import deepspeed.moe.utils
        from deepspeed.moe.sharded_moe import TopKGate

        assert deepspeed.moe.layer.MoE is MoE
        assert deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer is \
            split_params_into_different_moe_groups_for_optimizer
        assert TopKGate is importlib.import_module("dsplug.plugins.moe.sharded_moe").TopKGate
        assert importlib.import_module("dsplug.moe").Experts is importlib.import_module("dsplug.moe.experts").Experts
    finally:
        finder.uninstall()
