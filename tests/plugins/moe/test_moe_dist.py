"""Expert parallelism over 2 real processes (gloo): the ep_size-2 layer equals the single-process
layer with the same weights on the same tokens (outputs, l_aux, counts, gradients), its
all-to-all goes through dsplug.comm, and engine training with ZeRO equals a single-process run."""
from __future__ import annotations

import pytest
import torch

from dsplug import hookimpl
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.multiprocess

D, H, E = 8, 16, 4


def ffn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D))


def reference_moe(seed: int, **kwargs):
    """The single-process layer (ep_size 1) with distinct weights per expert, built alike on every rank."""
    from dsplug.moe.layer import MoE

    moe = MoE(D, ffn(), num_experts=E, ep_size=1, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return moe


def copy_into_ep(ep_moe, ref, ep_rank: int) -> None:
    """The ep layer's local expert i is the reference's expert ep_rank * num_local + i."""
    with torch.no_grad():
        ep_moe.deepspeed_moe.gate.wg.weight.copy_(ref.deepspeed_moe.gate.wg.weight)
        n = ep_moe.num_local_experts
        for i, expert in enumerate(ep_moe.deepspeed_moe.experts.deepspeed_experts):
            expert.load_state_dict(ref.deepspeed_moe.experts.deepspeed_experts[ep_rank * n + i].state_dict())


class Bytes:
    def __init__(self):
        self.ops = []

    @hookimpl
    def dsplug_comm_op(self, op, nbytes):
        self.ops.append((op, int(nbytes)))


CONFIGS = [dict(k=1, capacity_factor=1.0, min_capacity=0, use_rts=False),  # drops tokens
           dict(k=1, drop_tokens=False),
           dict(k=2, capacity_factor=0.75, min_capacity=0, top2_2nd_expert_sampling=False),
           dict(k=3, capacity_factor=1.0, min_capacity=0)]


def _layer_equivalence():
    from dsplug import comm
    from dsplug.moe.layer import MoE

    comm.init_distributed(verbose=False)
    rank = comm.get_rank()
    results = []
    for index, kwargs in enumerate(CONFIGS):
        ref = reference_moe(100 + index, **kwargs)
        ep = MoE(D, ffn(), num_experts=E, ep_size=2, **kwargs)
        ep.set_deepspeed_parallelism()
        copy_into_ep(ep, ref, rank)
        g = torch.Generator().manual_seed(7 + index)
        xs = [torch.randn(3, 6, D, generator=g).requires_grad_(True) for _ in range(2)]  # every rank's tokens
        targets = [torch.randn(3, 6, D, generator=g) for _ in range(2)]

        counter = Bytes()
        comm.events.register(counter)
        try:
            out, l_aux, counts = ep(xs[rank])
            l_aux, out_value = l_aux.detach(), out.detach()
            loss = ((out - targets[rank]) ** 2).sum()
            loss.backward()
        finally:
            comm.events.unregister(counter)

        # the reference, in this process alone: rank r's tokens through the ep_size-1 layer
        ref_outs = [ref.deepspeed_moe(x) for x in xs]
        ref_losses = [((o - t) ** 2).sum() for o, t in zip(ref_outs, targets)]
        ref_out, ref_l_aux, ref_counts = ref.deepspeed_moe(xs[rank]), ref.deepspeed_moe.l_aux, \
            ref.deepspeed_moe.exp_counts
        # gate: this rank's loss only (the engine averages dense gradients over ranks later);
        # experts: every rank's tokens routed to them come back through the all-to-all
        gate_grad, x_grad = torch.autograd.grad(ref_losses[rank], [ref.deepspeed_moe.gate.wg.weight, xs[rank]],
                                                retain_graph=True)
        expert_params = list(ref.deepspeed_moe.experts.parameters())
        expert_grads = torch.autograd.grad(ref_losses[0] + ref_losses[1], expert_params, allow_unused=True)
        by_name = dict(zip([n for n, _ in ref.deepspeed_moe.experts.named_parameters()], expert_grads))
        n_local = ep.num_local_experts
        expert_err = 0.0
        for name, p in ep.deepspeed_moe.experts.named_parameters():
            parts = name.split(".")
            parts[1] = str(rank * n_local + int(parts[1]))
            want = by_name[".".join(parts)]
            want = torch.zeros_like(p) if want is None else want
            expert_err = max(expert_err, float((p.grad - want).abs().max()))
        results.append(dict(
            out_err=float((out_value - ref_out).abs().max()), l_aux=(float(l_aux), float(ref_l_aux.detach())),
            x_err=float((xs[rank].grad - x_grad).abs().max()),
            counts=(counts.tolist(), ref_counts.tolist()),
            gate_err=float((ep.deepspeed_moe.gate.wg.weight.grad - gate_grad).abs().max()),
            expert_err=expert_err, dropped=int(ref_counts.sum()) - int((ref_out.detach().abs().sum(-1) > 0).sum()),
            ops=counter.ops, slots=int(ep.deepspeed_moe.exp_counts.sum())))
    return results


@pytest.mark.slow
def test_ep2_layer_equals_the_single_process_layer():
    per_rank = run_distributed(_layer_equivalence, 2)
    for rank, results in enumerate(per_rank):
        for kwargs, r in zip(CONFIGS, results):
            assert r["out_err"] < 1e-5, (rank, kwargs, r)
            assert r["l_aux"][0] == pytest.approx(r["l_aux"][1], rel=1e-6)
            assert r["counts"][0] == r["counts"][1]
            assert r["gate_err"] < 1e-4 and r["expert_err"] < 1e-4 and r["x_err"] < 1e-4, (rank, kwargs, r)
            # dispatch and combine: one all-to-all each way in forward and again in backward,
            # every one through dsplug.comm with the [E, C, D] fp32 slots as its message
            ops = r["ops"]
            a2a = [b for op, b in ops if op == "all_to_all_single"]
            assert len(a2a) == 4, ops
            assert len(set(a2a)) == 1 and a2a[0] % (E * D * 4) == 0
    # the capacity-limited configuration really dropped tokens (so the comparison covers dropping)
    assert per_rank[0][0]["dropped"] > 0 or per_rank[1][0]["dropped"] > 0


# ------------------------------------------------------------------ engine training
RANKS, STEPS, LR = 2, 4, 0.1


def optimizer(groups):
    """SGD with momentum: its update scales with the gradient (Adam's would hide a wrong scale)."""
    return torch.optim.SGD(groups, lr=LR, momentum=0.9)


class MoENet(torch.nn.Module):
    """inp -> MoE -> head; ``x`` is [R, B, T, D]: the loss is the mean over the R chunks of each
    chunk's loss, the MoE gating each chunk apart (so one process on R chunks equals R ranks with
    one chunk each)."""

    def __init__(self, ep_size: int):
        super().__init__()
        from dsplug.moe.layer import MoE

        self.inp = torch.nn.Linear(D, D)
        self.moe = MoE(D, ffn(), num_experts=E, ep_size=ep_size, k=1, capacity_factor=1.0, min_capacity=0,
                       use_rts=False)
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x, y):
        losses = []
        for r in range(x.shape[0]):
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x[r])))
            losses.append(((self.head(h) - y[r]) ** 2).mean() + 0.01 * l_aux)
        return torch.stack(losses).mean()


def make_net(ep_size: int, ep_rank: int = 0) -> MoENet:
    """Seeded weights, each expert its own; the ep_size-N net holds experts ep_rank*E/N ... of them."""
    full = MoENet(1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    if ep_size == 1:
        return full
    net = MoENet(ep_size)
    state = {k: v for k, v in full.state_dict().items() if ".deepspeed_experts." not in k}
    n = E // ep_size
    for k, v in full.state_dict().items():
        if ".deepspeed_experts." in k:
            head, rest = k.split(".deepspeed_experts.")
            expert, tail = rest.split(".", 1)
            if ep_rank * n <= int(expert) < (ep_rank + 1) * n:
                state[f"{head}.deepspeed_experts.{int(expert) - ep_rank * n}.{tail}"] = v
    net.load_state_dict(state)
    return net


def data(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(RANKS, 2, 5, D, generator=g), torch.randn(RANKS, 2, 5, 1, generator=g)


def global_state(net, ep_size: int, ep_rank: int) -> dict:
    """The net's state under the ep_size-1 names (local expert ids -> global ids)."""
    n = E // ep_size
    out = {}
    for k, v in net.state_dict().items():
        if ".deepspeed_experts." in k:
            head, rest = k.split(".deepspeed_experts.")
            expert, tail = rest.split(".", 1)
            k = f"{head}.deepspeed_experts.{ep_rank * n + int(expert)}.{tail}"
        out[k] = v.detach().clone()
    return out


def reference_training(steps: int = STEPS):
    """Plain PyTorch, one process, ep_size 1, all R chunks: the single-process equivalent."""
    from dsplug.moe.utils import split_params_into_different_moe_groups_for_optimizer

    net = make_net(1)
    opt = optimizer(split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "all"}))
    losses = []
    for step in range(steps):
        x, y = data(step)
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, global_state(net, 1, 0)


def _engine_training(stages):
    import dsplug
    from dsplug import comm
    from dsplug.moe.utils import split_params_into_different_moe_groups_for_optimizer

    comm.init_distributed(verbose=False)
    rank = comm.get_rank()
    out = {}
    for stage in stages:
        net = make_net(2, rank)
        net.moe.set_deepspeed_parallelism()  # the groups exist before the engine reduces in them
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()),
                                                                       "name": "all"})
        engine, *_ = dsplug.initialize(model=net, model_parameters=groups,
                                       optimizer=optimizer,
                                       config={"train_micro_batch_size_per_gpu": 1,
                                               "zero_optimization": {"stage": stage}})
        losses = []
        for step in range(STEPS):
            x, y = data(step)
            loss = engine(x[rank:rank + 1], y[rank:rank + 1])
            engine.backward(loss)
            engine.step()
            t = loss.detach().reshape(1).clone()
            comm.all_reduce(t)
            losses.append(float(t) / 2)
        out[stage] = (losses, global_state(net, 2, rank))
    return out


def assert_matches_reference(per_rank, stage, want_losses, want_state):
    for rank, result in enumerate(per_rank):
        losses, state = result[stage]
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6), (stage, rank)
        for k, v in state.items():
            torch.testing.assert_close(v, want_state[k], rtol=1e-5, atol=1e-6, msg=f"stage {stage} rank {rank}: {k}")
    # the two ranks hold different experts: together every expert once
    assert set(per_rank[0][stage][1]) | set(per_rank[1][stage][1]) == set(want_state)


@pytest.mark.slow
def test_ep2_training_with_zero_equals_one_process():
    stages = [0, 1, 2]
    per_rank = run_distributed(_engine_training, 2, stages)
    want_losses, want_state = reference_training()
    for stage in stages:
        assert_matches_reference(per_rank, stage, want_losses, want_state)
