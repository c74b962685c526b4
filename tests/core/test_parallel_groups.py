"""Process groups: a user's model-parallel unit (``initialize(mpu=...)``), expert groups, and the
data-parallel reductions of the ZeRO stages inside them.

4 real processes over gloo: model-parallel slices {0,1} and {2,3} (Megatron's layout: consecutive
ranks), data-parallel groups {0,2} and {1,3}. Each slice trains its own model (seeded by its
model-parallel rank), so a reduction that leaked across slices would show; the reference is a
plain torch loop per slice on the concatenated batches of that slice's data-parallel ranks.
"""
from __future__ import annotations

import os

import pytest
import torch

from dsplug.comm.bound import GroupComm
from dsplug.utils import groups

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.multiprocess

MP = 2
STEPS = 3
LR = 0.05


class ToyMpu:
    """The six methods DeepSpeed asks of a model-parallel unit (``mp`` consecutive ranks per slice)."""

    def __init__(self, mp: int):
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.mp, self.rank = mp, rank
        self.mp_groups = [dist.new_group(list(range(s, s + mp))) for s in range(0, world, mp)]
        self.dp_groups = [dist.new_group(list(range(i, world, mp))) for i in range(mp)]
        self.world = world

    def get_model_parallel_rank(self):
        return self.rank % self.mp

    def get_model_parallel_world_size(self):
        return self.mp

    def get_model_parallel_group(self):
        return self.mp_groups[self.rank // self.mp]

    def get_data_parallel_rank(self):
        return self.rank // self.mp

    def get_data_parallel_world_size(self):
        return self.world // self.mp

    def get_data_parallel_group(self):
        return self.dp_groups[self.rank % self.mp]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage}}


def _reference(mp_rank: int, dp_world: int):
    model = _model(100 + mp_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        xs, ys = zip(*[_batch(step, r) for r in range(dp_world)])
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_with_mpu(stage: int, save_dir: str):
    import dsplug

    dsplug.init_distributed()
    mpu = ToyMpu(MP)
    engine, *_ = dsplug.initialize(model=_model(100 + mpu.get_model_parallel_rank()), config=_config(stage), mpu=mpu)
    assert engine.world_size == 2 and engine.context.rank == mpu.get_data_parallel_rank()
    assert groups._get_data_parallel_group() is mpu.get_data_parallel_group()
    for step in range(STEPS - 1):
        x, y = _batch(step, mpu.get_data_parallel_rank())
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    # a fresh engine resumes the last step from the checkpoint
    fresh, *_ = dsplug.initialize(model=_model(7), config=_config(stage), mpu=mpu)
    fresh.load_checkpoint(save_dir, tag="t")
    x, y = _batch(STEPS - 1, mpu.get_data_parallel_rank())
    fresh.backward(torch.nn.functional.mse_loss(fresh(x), y))
    fresh.step()
    params = [p.detach().clone() for p in fresh.module.parameters()]
    files = sorted(os.listdir(os.path.join(save_dir, "t")))
    groups.set_mpu(None)
    return mpu.get_model_parallel_rank(), params, files


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_mpu_data_parallel_reductions_stay_inside_each_slice(stage, tmp_path):
    results = run_distributed(_train_with_mpu, 4, stage, str(tmp_path))
    for mp_rank, params, files in results:
        for got, want in zip(params, _reference(mp_rank, dp_world=2)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[0][1][0], results[1][1][0])  # the slices hold different models
    files = results[0][2]
    assert "mp_rank_00_model_states.pt" in files and "mp_rank_01_model_states.pt" in files
    for dp in range(2):
        for mp in range(2):
            assert f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" in files


def test_mpu_without_the_six_methods_is_refused():
    class Half:
        def get_data_parallel_group(self):
            return None

    with pytest.raises(TypeError, match="get_model_parallel_rank"):
        groups.set_mpu(Half())
    assert groups.get_mpu() is None


# --------------------------------------------------------------------------- expert groups
@pytest.mark.parametrize("world,ep,expected_ep,expected_edp", [
    (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (4, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (4, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
])
def test_expert_layout(world, ep, expected_ep, expected_edp):
    assert groups.expert_layout(list(range(world)), ep) == (expected_ep, expected_edp)


def test_expert_layout_data_before_expert():
    assert groups.expert_layout(list(range(4)), 2, use_data_before_expert_parallel_=True) == \
        ([[0, 2], [1, 3]], [[0, 1], [2, 3]])


def test_expert_size_must_divide_the_data_parallel_world():
    with pytest.raises(ValueError, match=r"expert parallel size 3 must divide .* 4 \(valid: \[1, 2, 4\]\)"):
        groups.expert_layout(list(range(4)), 3)


def test_unknown_expert_group_names_what_exists():
    with pytest.raises(KeyError, match="ep_size_8"):
        groups._get_expert_parallel_group("ep_size_8")


class ExpertToy(torch.nn.Module):
    """A dense layer plus one 'expert' per rank that only this rank's tokens reach when ep = world
    (no all-to-all needed for the reduction test): with allreduce=False its gradient must be
    reduced in the expert-data-parallel group only."""

    def __init__(self, group_name: str = "ep_size_2"):
        super().__init__()
        self.dense = torch.nn.Linear(6, 4)
        self.expert = torch.nn.Linear(4, 1)
        self.expert.weight.allreduce = False
        self.expert.weight.group_name = group_name
        self.expert.bias.allreduce = False
        self.expert.bias.group_name = group_name

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x)))


def _train_expert_toy(stage: int, tag_dir: str):
    import dsplug

    dsplug.init_distributed()  # the engine creates the 'ep_size_2' groups the experts name
    rank = dsplug.comm.get_rank()
    torch.manual_seed(0)
    model = ExpertToy()
    with torch.no_grad():  # each expert-parallel rank holds a different expert
        model.expert.weight.fill_(0.1 * (rank % 2 + 1))
        model.expert.bias.fill_(0.0)
    cfg = _config(stage)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
    cfg["zero_allow_untested_optimizer"] = True
    cfg["gradient_clipping"] = 1e6  # no effect, but the norm is computed (and reported)
    # stages 1-2 partition experts in their own param group (DeepSpeed's requirement too)
    param_groups = [{"params": list(model.dense.parameters())},
                    {"params": list(model.expert.parameters()), "moe": True, "name": "ep_size_2"}]
    engine, *_ = dsplug.initialize(model=model, config=cfg, model_parameters=param_groups)
    x, _ = _batch(0, rank)
    engine.backward(engine(x).sum())
    engine.step()
    norm = engine.get_global_grad_norm()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = engine.stage.full_fp32_param(model.expert.weight)  # assembled in the expert-data-parallel group
    engine.save_checkpoint(tag_dir, tag="moe")
    fresh_model = ExpertToy()
    fresh, *_ = dsplug.initialize(model=fresh_model, config=cfg,
                                  model_parameters=[{"params": list(fresh_model.dense.parameters())},
                                                    {"params": list(fresh_model.expert.parameters()), "moe": True}])
    fresh.load_checkpoint(tag_dir, tag="moe")
    reloaded = {n: p.detach().clone() for n, p in fresh_model.named_parameters()}
    groups._reset_for_tests()
    return rank, after, full, reloaded, norm


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_expert_gradients_are_reduced_in_the_expert_data_parallel_group(stage, tmp_path):
    """4 ranks, ep 2: experts {0,2} are copies of one expert, {1,3} of the other. The SGD step
    (lr 1) moves each expert by minus the sum of its two holders' gradients over 4 (the
    data-parallel world), the dense layer by minus the mean over all 4 ranks; a checkpoint
    reloads each rank's own expert."""
    results = {r: rest for r, *rest in run_distributed(_train_expert_toy, 4, stage, str(tmp_path))}
    torch.manual_seed(0)
    base = ExpertToy()
    dense_grads, expert_grads = [], {}
    for rank in range(4):
        model = ExpertToy()
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            model.expert.weight.fill_(0.1 * (rank % 2 + 1))
            model.expert.bias.fill_(0.0)
        x, _ = _batch(0, rank)
        model(x).sum().backward()
        dense_grads.append([model.dense.weight.grad, model.dense.bias.grad])
        expert_grads.setdefault(rank % 2, []).append([model.expert.weight.grad, model.expert.bias.grad])
    true_grads = [sum(g[0] for g in dense_grads) / 4, sum(g[1] for g in dense_grads) / 4]
    for held in expert_grads.values():
        true_grads += [(held[0][0] + held[1][0]) / 4, (held[0][1] + held[1][1]) / 4]
    true_norm = float(torch.sqrt(sum((g ** 2).sum() for g in true_grads)))
    for rank, (params, full, reloaded, norm) in results.items():
        assert norm == pytest.approx(true_norm, rel=1e-5)  # every expert once, on every rank
        torch.testing.assert_close(params["dense.weight"], base.dense.weight - sum(g[0] for g in dense_grads) / 4)
        torch.testing.assert_close(params["dense.bias"], base.dense.bias - sum(g[1] for g in dense_grads) / 4)
        held = expert_grads[rank % 2]
        start = torch.full_like(base.expert.weight, 0.1 * (rank % 2 + 1))
        torch.testing.assert_close(params["expert.weight"], start - (held[0][0] + held[1][0]) / 4)
        torch.testing.assert_close(params["expert.bias"], -(held[0][1] + held[1][1]) / 4)
        torch.testing.assert_close(full, params["expert.weight"])
        for name, value in params.items():
            torch.testing.assert_close(reloaded[name], value)


def test_stage3_refuses_expert_parameters():
    import dsplug

    with pytest.raises(ValueError, match="zero_optimization.stage=3: the model has 2 MoE expert"):
        dsplug.initialize(model=ExpertToy("ep_size_1"), config=_config(3))


def test_an_expert_group_that_does_not_divide_the_world_is_refused():
    import dsplug

    with pytest.raises(ValueError, match=r"expert parallel size 2 must divide the data-parallel world size 1"):
        dsplug.initialize(model=ExpertToy("ep_size_2"), config=_config(0))
    with pytest.raises(ValueError, match="group_name='experts'.*'ep_size_<expert parallel size>'"):
        dsplug.initialize(model=ExpertToy("experts"), config=_config(0))


def test_a_param_group_mixing_experts_and_dense_parameters_is_refused_at_stage1():
    import dsplug

    with pytest.raises(ValueError, match="param group 0 mixes MoE expert parameters .*expert.weight.*"
                                         "split_params_into_different_moe_groups_for_optimizer"):
        dsplug.initialize(model=ExpertToy("ep_size_1"), config=_config(1))


def test_group_comm_translates_group_ranks():
    bound = GroupComm(None, group="g", ranks=[1, 3])
    assert bound.global_rank(1) == 3 and bound.group_rank(1) == 0
    assert bound.get_world_size() == 2



def test_group_comm_binds_every_collective_of_the_comm_layer():
    """A comm function taking ``group`` that GroupComm does not override would silently run on
    the world group under an mpu."""
    import inspect

    import dsplug.comm as comm_module

    missing = []
    for name, fn in vars(comm_module).items():
        if name.startswith("_") or not inspect.isfunction(fn) or name in vars(GroupComm):
            continue
        if "group" in inspect.signature(fn).parameters and fn.__module__ == comm_module.__name__:
            missing.append(name)
    assert not missing, f"GroupComm lacks {missing}"


def _refusals_with_mpu():
    import dsplug

    dsplug.init_distributed()
    mpu = ToyMpu(2)
    out = []
    for extra in ({"gradient_clipping": 1.0}, {"fp16": {"enabled": True}}):
        try:
            dsplug.initialize(model=_model(0), config={**_config(0), **extra}, mpu=mpu)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    groups.set_mpu(None)
    return out


def test_clipping_and_fp16_are_refused_across_model_parallel_slices():
    for messages in run_distributed(_refusals_with_mpu, 2):
        assert "gradient_clipping=1.0 with a model-parallel unit of 2 slices" in messages[0]
        assert "fp16 with a model-parallel unit of 2 slices" in messages[1]
