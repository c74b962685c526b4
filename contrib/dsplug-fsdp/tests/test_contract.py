"""fsdp2 against dsplug's ZeRO-stage contract (one process: a world of one rank)."""
from __future__ import annotations

import dsplug_fsdp.plugin as plugin

from dsplug.testing import ZeroStageContract


class TestFsdp2Stage(ZeroStageContract):
    plugin_name = "fsdp2"
    # registered at runtime when the distribution is not installed (a no-op when it is)
    plugins = (plugin,)
    distribution = "dsplug-fsdp"


# ------------------------------------------------------------------ what is particular to fsdp2
import pytest  # noqa: E402
import torch  # noqa: E402

from dsplug.config.schema import ConfigError  # noqa: E402
from dsplug.contracts import Precision  # noqa: E402
from dsplug.testing import tiny_engine, train_steps  # noqa: E402
from dsplug_fsdp.stage import units_to_shard  # noqa: E402


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                           for _ in range(3)])
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _engine(config=None, model=None):
    config = dict(config or {})
    zero = {"stage": "fsdp2", **config.pop("zero_optimization", {})}
    return tiny_engine({"zero_optimization": zero, **config}, plugins=(plugin,), model=model)


def test_units_are_the_outermost_module_list_entries_else_sequential_children():
    model = Blocks()
    assert units_to_shard(model, []) == list(model.layers)
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    assert units_to_shard(seq, []) == [seq[0], seq[2]]
    assert units_to_shard(model, ["Linear"]) == list(reversed([m for m in model.modules()
                                                               if isinstance(m, torch.nn.Linear)]))


def test_a_wrap_class_the_model_lacks_is_a_config_error_naming_fsdp2_wrap():
    with pytest.raises(ConfigError, match=r"zero_optimization\.wrap: no submodule with parameters is of class "
                                          r"\['Block'\]"):
        _engine({"zero_optimization": {"wrap": ["Block"]}}, model=Blocks())


def test_how_the_model_is_cut_into_units_changes_no_number():
    auto = _engine(model=Blocks())  # the three ModuleList entries, then the root
    linears = _engine({"zero_optimization": {"wrap": ["Linear"]}}, model=Blocks())  # every Linear its own unit
    assert (auto.stage.units, linears.stage.units) == (4, 6)
    torch.testing.assert_close(train_steps(auto, 3), train_steps(linears, 3), rtol=0, atol=0)
    for key, value in auto.stage.module_state_dict().items():
        assert torch.equal(linears.stage.module_state_dict()[key], value), key


def test_fp32_master_weights_of_an_fp32_model_are_refused():
    class Odd(Precision):
        name = "odd"
        model_dtype = torch.float32
        master_weights = True

    import dsplug.comm

    dsplug.comm.init_distributed(verbose=False)
    suite = TestFsdp2Stage()
    suite.tmp_path = "."
    context = suite.context()
    model = harness_model()
    with pytest.raises(ConfigError, match="precision 'odd' keeps master weights of an fp32 model"):
        plugin.build_fsdp2_stage(model, [{"params": list(model.parameters())}], torch.optim.SGD, Odd(),
                                 context.config.section("zero_optimization"), context)


def test_a_model_sharded_by_an_earlier_engine_is_refused():
    model = Blocks()
    first = _engine(model=model)  # still alive: the engine's model.to(device) swaps its DTensor parameters
    with pytest.raises(ValueError, match="already sharded by FSDP2"):
        _engine(model=model)
    first.destroy()


def test_the_dtensor_parameters_move_with_module_to_while_the_engine_lives():
    from dsplug.contracts.zero_stage import stage_of
    from torch.distributed.tensor import DTensor

    engine = _engine(model=Blocks())
    params = list(engine.module.parameters())
    assert all(isinstance(p, DTensor) and stage_of(p) is engine.stage for p in params)
    engine.module.to("cpu")  # torch swaps DTensor parameters in place (swap_tensors)
    assert all(a is b for a, b in zip(params, engine.module.parameters()))


def test_its_keys_of_zero_optimization_belong_to_it_alone():
    from dsplug.config import check_config
    from dsplug.testing import make_registry, tiny_config

    registry = make_registry(plugin)
    error = check_config(tiny_config({"zero_optimization": {"stage": 3, "reshard_after_forward": False}}),
                         registry=registry)
    assert "zero_optimization.reshard_after_forward: is a key of the zero_stage 'fsdp2'" in str(error)
    error = check_config(tiny_config({"zero_optimization": {"stage": "fsdp2", "reshard_after_foward": False}}),
                         registry=registry)
    assert "did you mean 'zero_optimization.reshard_after_forward'?" in str(error)
    engine = _engine({"zero_optimization": {"reshard_after_forward": False}}, model=Blocks())
    assert engine.config.selected_params("zero_stage").reshard_after_forward is False
    assert engine.config["zero_optimization"]["reshard_after_forward"] is False


def test_moe_expert_parameters_are_refused():
    model = Blocks()
    model.out.weight.allreduce = False  # DeepSpeed's marks of an expert parameter
    model.out.weight.group_name = "ep_size_1"
    with pytest.raises(ValueError, match=r"does not train MoE expert parameters .*'out.weight'"):
        _engine(model=model)


def test_memory_is_this_ranks_rows():
    engine = _engine()
    train_steps(engine, 1)
    memory = engine.stage.memory_breakdown()
    params = sum(p.numel() * 4 for p in engine.module.parameters())  # one rank: every row
    assert memory["parameters"] == params and memory["gradients"] == 0  # (dropped after the step)
    assert memory["total"] == memory["parameters"] + memory["optimizer_states"]


def harness_model():
    from dsplug.testing import tiny_model

    return tiny_model()


@pytest.mark.parametrize("source,target", [("fsdp2", 3), (3, "fsdp2")])
def test_module_weights_move_between_fsdp2_and_stage_3(tmp_path, source, target):
    """load_module_only=True: the shared file holds the full module at both stages."""
    saved = tiny_engine({"zero_optimization": {"stage": source}}, plugins=(plugin,))
    train_steps(saved, 2)
    saved.save_checkpoint(str(tmp_path), tag="t")
    want = {k: v.clone() for k, v in saved.stage.module_state_dict().items()}
    loaded = tiny_engine({"zero_optimization": {"stage": target}}, plugins=(plugin,), seed=1)
    loaded.load_checkpoint(str(tmp_path), tag="t", load_module_only=True)
    got = loaded.stage.module_state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_loading_another_stages_optimizer_state_says_what_to_do(tmp_path):
    saved = tiny_engine({"zero_optimization": {"stage": 3}}, plugins=(plugin,))
    train_steps(saved, 1)
    saved.save_checkpoint(str(tmp_path), tag="t")
    loaded = _engine()
    with pytest.raises(Exception, match="not written by the ZeRO stage 'fsdp2'.*load_module_only=True"):
        loaded.load_checkpoint(str(tmp_path), tag="t")


def test_save_16bit_model_writes_the_full_weights_in_the_training_dtype(tmp_path):
    engine = _engine({"bf16": {"enabled": True}})
    train_steps(engine, 2)
    assert engine.save_16bit_model(str(tmp_path), "model.bin")
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    masters = {n: engine.stage.full_fp32_param(p) for n, p in engine.module.named_parameters()}
    assert set(saved) == set(masters)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, masters[name].to(torch.bfloat16)), name


# ------------------------------------------------------------------ on two ranks (dsplug.testing.run_ranks)
def _gather_on_two_ranks(precision):
    import dsplug
    import dsplug.zero

    config = {"train_batch_size": 4}
    if precision:
        config[precision] = {"enabled": True}
    engine = _engine(config, model=Blocks())
    train_steps(engine, 1)
    first = engine.module.layers[0][0]
    weight = first.weight  # the DTensor parameter (this rank's rows)
    with dsplug.zero.GatheredParameters([weight, first.bias], modifier_rank=1):
        full = first.weight
        seen = (tuple(full.shape), full.dtype, full.detach().float().clone())
        with torch.no_grad():
            first.weight.fill_(dsplug.comm.get_rank() + 0.5)  # rank 1's 1.5 is kept
    kept = engine.stage.full_fp32_param(weight)
    with dsplug.zero.GatheredParameters(weight):  # read only: a change is dropped
        with torch.no_grad():
            first.weight.fill_(-7.0)
    after = engine.stage.full_fp32_param(weight)
    losses = train_steps(engine, 1)
    return {"seen": seen, "kept": kept, "after": after, "restored": first.weight is weight, "losses": losses,
            "module": {k: v.float() for k, v in engine.stage.module_state_dict().items()}}


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_gathered_parameters_on_two_ranks(precision):
    from dsplug.testing import run_ranks

    ranks = run_ranks(_gather_on_two_ranks, 2, precision)
    dtype = torch.bfloat16 if precision else torch.float32
    for rank, out in enumerate(ranks):
        shape, got_dtype, values = out["seen"]
        assert (shape, got_dtype) == ((16, 16), dtype), rank
        assert torch.equal(values, ranks[0]["seen"][2]), rank  # the same full value on every rank
        assert torch.equal(out["kept"], torch.full((16, 16), 1.5)) and torch.equal(out["after"], out["kept"]), rank
        assert out["restored"], rank
        assert len(out["losses"]) == 1, rank  # it trains on after the blocks
        for key, value in ranks[0]["module"].items():  # trained on from the kept values, alike on both ranks
            assert torch.equal(out["module"][key], value), (rank, key)
