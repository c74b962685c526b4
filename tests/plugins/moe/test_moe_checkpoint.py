"""MoE checkpoints: one file per expert in DeepSpeed's layout (global expert ids, the model file
without experts), reloaded at the same and at another ep_size / world size and continued exactly."""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.plugins.moe.test_moe_dist import E, data, global_state, make_net

pytestmark = pytest.mark.multiprocess

SAVE_AT, MORE = 2, 2


def sgd(momentum: float):
    return lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=momentum)


def engine_for(net, momentum: float, stage: int = 0, extra=None):
    import dsplug
    from dsplug.moe.utils import split_params_into_different_moe_groups_for_optimizer

    net.moe.set_deepspeed_parallelism()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "all"})
    engine, *_ = dsplug.initialize(model=net, model_parameters=groups, optimizer=sgd(momentum),
                                   config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                                           **(extra or {})})
    return engine


def train(engine, steps, chunk=None):
    """Steps on the data of ``steps``; ``chunk`` = this rank's chunk (None: all chunks, one process)."""
    for step in steps:
        x, y = data(step)
        if chunk is not None:
            x, y = x[chunk:chunk + 1], y[chunk:chunk + 1]
        dtype = next(engine.module.parameters()).dtype  # bf16 engines take bf16 inputs
        loss = engine(x.to(dtype) if x.is_floating_point() else x, y.to(dtype) if y.is_floating_point() else y)
        engine.backward(loss)
        engine.step()


def scrambled(net):
    with torch.no_grad():
        for p in net.parameters():
            p.uniform_(-1, 1)
    return net


def _two_ranks(tmp: str):
    from dsplug import comm

    comm.init_distributed(verbose=False)
    rank = comm.get_rank()
    out = {}
    # A. the same layout (2 ranks, ep 2) with stateful SGD (momentum): save, continue; reload, continue
    for stage in (0, 2):
        engine = engine_for(make_net(2, rank), momentum=0.9, stage=stage)
        train(engine, range(SAVE_AT), rank)
        engine.save_checkpoint(os.path.join(tmp, "ep2"), tag=f"a{stage}")
        train(engine, range(SAVE_AT, SAVE_AT + MORE), rank)
        out[f"A{stage}_straight"] = global_state(engine.module, 2, rank)
        engine = engine_for(scrambled(make_net(2, rank)), momentum=0.9, stage=stage)
        engine.load_checkpoint(os.path.join(tmp, "ep2"), tag=f"a{stage}")
        train(engine, range(SAVE_AT, SAVE_AT + MORE), rank)
        out[f"A{stage}_resumed"] = global_state(engine.module, 2, rank)
        out[f"A{stage}_steps"] = engine.global_steps
    # B2. ZeRO stage 2 with ep 2, to be loaded (weights only) by one process with ep 1
    engine = engine_for(make_net(2, rank), momentum=0.0, stage=2)
    train(engine, range(SAVE_AT), rank)
    engine.save_checkpoint(os.path.join(tmp, "ep2"), tag="b2")
    out["B2_saved"] = global_state(engine.module, 2, rank)
    # B. saved here with ep 2 (stateless SGD), to be resumed by one process with ep 1
    engine = engine_for(make_net(2, rank), momentum=0.0)
    train(engine, range(SAVE_AT), rank)
    engine.save_checkpoint(os.path.join(tmp, "ep2"), tag="b")
    train(engine, range(SAVE_AT, SAVE_AT + MORE), rank)
    out["B_straight"] = global_state(engine.module, 2, rank)
    return out


def _resume_at_ep2(tmp: str):
    """Resume one process's ep-1 checkpoint on 2 ranks with ep 2."""
    from dsplug import comm

    comm.init_distributed(verbose=False)
    rank = comm.get_rank()
    engine = engine_for(scrambled(make_net(2, rank)), momentum=0.0)
    engine.load_checkpoint(os.path.join(tmp, "ep1"), tag="c", load_optimizer_states=False)
    loaded = global_state(engine.module, 2, rank)
    train(engine, range(SAVE_AT, SAVE_AT + MORE), rank)
    return loaded, global_state(engine.module, 2, rank)


def assert_same(state, want, what):
    for k, v in state.items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.slow
def test_expert_files_and_reload_at_another_ep_size(tmp_path):
    from dsplug.checkpoint import CheckpointError

    per_rank = run_distributed(_two_ranks, 2, str(tmp_path))

    # DeepSpeed's layout: one file per (layer, global expert); the model file holds no expert
    tag = tmp_path / "ep2" / "a0"
    names = sorted(os.listdir(tag))
    assert [n for n in names if n.startswith("layer_")] == \
        [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(E)]
    model_file = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert not [k for k in model_file["module"] if "deepspeed_experts" in k]
    assert "moe.deepspeed_moe.gate.wg.weight" in model_file["module"]
    for e in range(E):
        expert = torch.load(tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt", weights_only=True)
        assert sorted(expert) == sorted(f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.{p}"
                                        for p in ("0.weight", "0.bias", "2.weight", "2.bias"))

    # A. the same layout continues exactly (momentum buffers included), ZeRO stages 0 and 2
    for rank, out in enumerate(per_rank):
        for stage in (0, 2):
            assert_same(out[f"A{stage}_resumed"], out[f"A{stage}_straight"], f"A stage {stage} rank {rank}")
            assert out[f"A{stage}_steps"] == SAVE_AT + MORE

    # B. saved with ep 2 on 2 ranks, resumed by one process with ep 1: continues exactly
    b_straight = {**per_rank[0]["B_straight"], **per_rank[1]["B_straight"]}
    engine = engine_for(scrambled(make_net(1)), momentum=0.0)
    with pytest.raises(CheckpointError, match="load_optimizer_states=False"):
        engine.load_checkpoint(str(tmp_path / "ep2"), tag="b")
    engine.load_checkpoint(str(tmp_path / "ep2"), tag="b", load_optimizer_states=False)
    assert engine.global_steps == SAVE_AT
    train(engine, range(SAVE_AT, SAVE_AT + MORE))
    resumed = global_state(engine.module, 1, 0)
    assert sorted(resumed) == sorted(b_straight)
    assert_same(resumed, b_straight, "B")

    # B2. ZeRO stage 2 partitions do not re-slice over experts: the weights load with load_module_only
    engine = engine_for(scrambled(make_net(1)), momentum=0.0, stage=2)
    with pytest.raises(CheckpointError, match="load_module_only=True"):
        engine.load_checkpoint(str(tmp_path / "ep2"), tag="b2")
    engine.load_checkpoint(str(tmp_path / "ep2"), tag="b2", load_module_only=True)
    assert_same(global_state(engine.module, 1, 0), {**per_rank[0]["B2_saved"], **per_rank[1]["B2_saved"]}, "B2")


@pytest.mark.slow
def test_one_process_ep1_checkpoint_resumes_on_two_ranks_with_ep2(tmp_path):
    engine = engine_for(make_net(1), momentum=0.0)
    train(engine, range(SAVE_AT))
    engine.save_checkpoint(str(tmp_path / "ep1"), tag="c")
    at_save = global_state(engine.module, 1, 0)
    train(engine, range(SAVE_AT, SAVE_AT + MORE))
    straight = global_state(engine.module, 1, 0)
    per_rank = run_distributed(_resume_at_ep2, 2, str(tmp_path))
    for rank, (loaded, _) in enumerate(per_rank):
        assert_same(loaded, at_save, f"loaded on rank {rank}")  # rank 1 holds experts 2, 3 of the file
    for rank, (_, resumed) in enumerate(per_rank):
        assert_same(resumed, straight, f"continued on rank {rank}")


def test_a_different_number_of_experts_is_refused(tmp_path):
    from dsplug.checkpoint import CheckpointError
    from tests.plugins.moe.test_moe_dist import MoENet

    engine = engine_for(make_net(1), momentum=0.0)
    engine.save_checkpoint(str(tmp_path), tag="t")

    class Wider(MoENet):
        def __init__(self):
            super().__init__(1)
            from dsplug.moe.layer import MoE
            from tests.plugins.moe.test_moe_dist import D, ffn

            self.moe = MoE(D, ffn(), num_experts=2 * E)

    other = engine_for(Wider(), momentum=0.0)
    with pytest.raises(CheckpointError, match=f"has {E} experts, the model {2 * E}; num_experts must match"):
        other.load_checkpoint(str(tmp_path), tag="t")


def _bf16_masters_at_ep2(tmp: str):
    from dsplug import comm

    comm.init_distributed(verbose=False)
    rank = comm.get_rank()
    engine = engine_for(scrambled(make_net(2, rank)), momentum=0.0, extra={"bf16": {"enabled": True}})
    engine.load_checkpoint(os.path.join(tmp, "bf16"), tag="c", load_optimizer_states=False)
    stage = engine.stage
    stale = [n for n, p in engine.module.named_parameters()  # experts: masters from the loaded weights
             if not getattr(p, "allreduce", True) and not torch.equal(stage.master[p], p.detach().float())]
    return global_state(engine.module, 2, rank), stale


def test_bf16_master_weights_of_experts_follow_the_new_layout(tmp_path):
    """At another expert layout the fp32 masters of the experts come from the experts the MoE
    plugin loaded, not from this rank's file (which held other experts): the next step would
    otherwise copy another rank's experts back over them."""
    engine = engine_for(make_net(1), momentum=0.0, extra={"bf16": {"enabled": True}})
    train(engine, range(SAVE_AT))
    engine.save_checkpoint(str(tmp_path / "bf16"), tag="c")
    at_save = global_state(engine.module, 1, 0)
    for rank, (loaded, stale) in enumerate(run_distributed(_bf16_masters_at_ep2, 2, str(tmp_path))):
        assert_same(loaded, at_save, f"loaded on rank {rank}")
        assert stale == [], f"rank {rank}: expert masters differ from the loaded experts: {stale}"
