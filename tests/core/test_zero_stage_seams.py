"""The seams a third-party ZeRO stage reaches from the documented contract alone (issue 22's fsdp2
author's gaps), each driven by the tiny stage ``toy`` defined here:

* a stage may replace the module's Parameters: ``stage_of`` finds the new ones, and ``module.to()``
  can swap them while the engine lives (the engine keeps no weak reference to a parameter);
* ``ZeroStage.gathered``: ``dsplug.zero.GatheredParameters`` and the kernel's
  ``gathered_parameters`` hand a stage's parameters to it (modifier_rank semantics on 2 ranks);
* ``context.comm.group``: None for the world, a GroupComm's process group otherwise;
* ``PluginSpec.schema`` on a ``zero_stage``: its own keys in ``zero_optimization``, validated only
  while it is selected (typos get did-you-mean, another stage's key names that stage);
* ``dsplug.testing.run_ranks``: N gloo ranks on 127.0.0.1, results by rank.
"""
from __future__ import annotations

import contextlib
import gc
import sys

import pytest
import torch

import dsplug
from dsplug import PluginSpec, hookimpl
from dsplug.config.dsconfig import DsplugConfig
from dsplug.config.schema import ConfigError, field, schema
from dsplug.contracts import ZeroStage, ZeroStageTraits
from dsplug.contracts.zero_stage import _OWNERS, gathered_parameters, stage_of
from dsplug.testing import RankFailed, make_registry, run_ranks, tiny_config, tiny_engine, train_steps

TRAITS = ZeroStageTraits()


@schema
class ToyOptions:
    grad_scale: float = field(1.0, gt=0, doc="gradients are multiplied by this before the step")


class ToyStage(ZeroStage):
    """Data parallel over fresh Parameter objects of its own (as FSDP2 puts DTensors in the
    module); ``gathered`` broadcasts the modifier rank's values on exit."""

    stage = "toy"
    traits = TRAITS

    def __init__(self, module, param_groups, build_optimizer, precision, section, context):
        self.module, self.precision, self.comm = module, precision, context.comm
        self.world_size = context.world_size
        self.options = context.config.selected_params("zero_stage")
        group = context.comm.group if context.comm.group is not None else torch.distributed.group.WORLD
        self.group_size = torch.distributed.get_world_size(group)
        self.originals = {}
        replaced = {}
        for name, p in list(module.named_parameters()):
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            mine = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            setattr(owner, leaf, mine)
            self.originals[name] = p
            replaced[id(p)] = mine
        groups = [{**g, "params": [replaced[id(p)] for p in g["params"]]} for g in param_groups]
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = build_optimizer(groups)
        self.gather_calls = []

    def after_backward(self):
        for p in self.params:
            if p.grad is not None and self.world_size > 1:
                self.comm.all_reduce(p.grad)
                p.grad.div_(self.world_size)

    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(self.options.grad_scale)
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state, load_optimizer_states=True, saved_world_size=None, read_rank=None):
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])

    def module_state_dict(self):
        return self.module.state_dict()

    def load_module_state_dict(self, state, strict=True):
        self.module.load_state_dict(state, strict=strict)

    def gathered(self, params, modifier_rank=None):
        self.gather_calls.append(([id(p) for p in params], modifier_rank))

        @contextlib.contextmanager
        def context():
            yield
            if modifier_rank is not None:
                with torch.no_grad():
                    for p in params:
                        self.comm.broadcast(p.data, src=modifier_rank)

        return context()


@hookimpl
def dsplug_zero_stages():
    return [PluginSpec(category="zero_stage", name="toy", factory=ToyStage, traits=TRAITS, schema=ToyOptions,
                       summary="test stage: replaces the Parameters, gathers by broadcast")]


PLUGIN = sys.modules[__name__]


def _toy(config=None, **kwargs):
    return tiny_engine({"zero_optimization": {"stage": "toy", **(config or {})}}, plugins=(PLUGIN,), **kwargs)


# ------------------------------------------------------------------ replaced Parameters
def test_stage_of_answers_for_the_parameters_the_stage_put_in_the_module():
    engine = _toy()
    stage = engine.stage
    for name, p in engine.module.named_parameters():
        assert stage_of(p) is stage, name
        assert p is not stage.originals[name]
        assert stage_of(stage.originals[name]) is None  # replaced before the engine recorded them
    assert stage_of(engine.module) is stage


def test_module_to_swaps_parameters_while_the_engine_lives():
    """torch swaps tensor subclasses (DTensor) in place with swap_tensors, which a weak reference to
    the parameter forbids; with the swap forced for every tensor, both a built-in stage's and a
    stage's own Parameters move."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for engine in (_toy(), tiny_engine({"zero_optimization": {"stage": 0}})):
            before = list(engine.module.parameters())
            engine.module.to("cpu")
            engine.module.to(torch.float64).to(torch.float32)
            after = list(engine.module.parameters())
            assert all(a is b for a, b in zip(before, after))  # swapped in place: same objects
            assert all(stage_of(p) is engine.stage for p in after)
            assert len(train_steps(engine, 1)) == 1
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_the_record_holds_no_parameter_and_goes_with_the_stage():
    import weakref

    engine = _toy()
    keys = [id(p) for p in engine.module.parameters()]
    assert all(k in _OWNERS for k in keys)
    engine.module[0].weight = torch.nn.Parameter(torch.zeros(16, 8))  # replaced after attach: not recorded
    assert stage_of(engine.module[0].weight) is None
    weak = weakref.ref(engine.module[2].weight)  # (the test's own weak reference)
    del engine  # never destroyed: the record must not keep the stage, module or parameters
    gc.collect()
    assert weak() is None
    assert not any(k in _OWNERS for k in keys)


# ------------------------------------------------------------------ ZeroStage.gathered
def test_gathered_parameters_hands_each_stage_its_own_parameters():
    import dsplug.zero

    toy, plain = _toy(), tiny_engine({"zero_optimization": {"stage": 0}})
    mine = list(toy.module.parameters())
    with dsplug.zero.GatheredParameters([mine[1], mine[0], mine[1], None] + list(plain.module.parameters()),
                                        modifier_rank=0) as gathered:
        assert gathered is not None
    assert toy.stage.gather_calls == [([id(mine[1]), id(mine[0])], 0)]  # deduplicated, in order; stage 0: None
    assert gathered_parameters(list(plain.module.parameters())) is None  # full values already
    assert gathered_parameters(mine[2]) is not None  # one tensor
    with dsplug.zero.GatheredParameters(mine, enabled=False):
        pass
    assert len(toy.stage.gather_calls) == 2  # enabled=False asked nothing


def _gather_on_two_ranks():
    import dsplug.zero

    engine = tiny_engine({"train_batch_size": 4, "zero_optimization": {"stage": "toy"}}, plugins=(PLUGIN,))
    weight = engine.module[0].weight
    with dsplug.zero.GatheredParameters(weight, modifier_rank=1):
        with torch.no_grad():
            weight.fill_(float(dsplug.comm.get_rank()) + 3)  # every rank writes; rank 1's values win
    kept = weight.detach().clone()
    with dsplug.zero.GatheredParameters(weight):  # read only
        with torch.no_grad():
            weight.fill_(-1.0)
    return {"kept": kept, "group_size": engine.stage.group_size, "comm_group": engine.context.comm.group,
            "calls": [m for _, m in engine.stage.gather_calls]}


def test_modifier_rank_values_reach_every_rank_through_the_stage():
    results = run_ranks(_gather_on_two_ranks, 2)
    for rank, out in enumerate(results):
        assert torch.equal(out["kept"], torch.full((16, 8), 4.0)), rank
        assert out["group_size"] == 2 and out["comm_group"] is None
        assert out["calls"] == [1, None]


# ------------------------------------------------------------------ context.comm.group
def test_comm_group_is_none_for_the_world():
    assert dsplug.comm.group is None
    from dsplug.comm.bound import GroupComm

    marker = object()
    assert GroupComm(dsplug.comm, marker, [0]).group is marker


# ------------------------------------------------------------------ a stage's own zero_optimization keys
def _config(zero, registry):
    return DsplugConfig(tiny_config({"zero_optimization": zero}), registry=registry)


def test_a_stage_reads_its_own_keys_of_zero_optimization():
    registry = make_registry(PLUGIN)
    config = _config({"stage": "toy", "grad_scale": 0.5}, registry)
    assert config.selected_params("zero_stage") == ToyOptions(grad_scale=0.5)
    assert config["zero_optimization"]["grad_scale"] == 0.5  # in the resolved dict
    assert DsplugConfig(config, registry=registry).selected_params("zero_stage") == ToyOptions(grad_scale=0.5)
    assert _config({"stage": "toy"}, registry).selected_params("zero_stage") == ToyOptions()
    assert _config({"stage": 0}, registry).selected_params("zero_stage") is None  # stage 0 declares none
    # and the stage trains with it: half the gradient, half the SGD update of the default
    base = tiny_engine(plugins=(PLUGIN,))
    toy = _toy({"grad_scale": 0.5})
    start = {n: p.detach().clone() for n, p in base.module.named_parameters()}
    train_steps(base, 1)
    train_steps(toy, 1)
    for name, p in toy.module.named_parameters():
        want = start[name] + 0.5 * (dict(base.module.named_parameters())[name].detach() - start[name])
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("zero,message", [
    ({"stage": "toy", "grad_scal": 2.0}, "zero_optimization.grad_scal: unknown key; did you mean "
                                         "'zero_optimization.grad_scale'?"),
    ({"stage": "toy", "stage3_prefetch_bucket_siz": 1}, "did you mean 'zero_optimization.stage3_prefetch_bucket_size'"),
    ({"stage": "toy", "grad_scale": 0}, "zero_optimization.grad_scale"),
    ({"stage": 2, "grad_scale": 2.0}, "zero_optimization.grad_scale: is a key of the zero_stage 'toy', which this "
                                      "config does not select (zero_optimization.stage selects '2')"),
    ({"stage": 3, "grad_scal": 2.0}, "zero_optimization.grad_scal: unknown key"),
])
def test_stage_keys_are_checked_only_for_the_selected_stage(zero, message):
    with pytest.raises(ConfigError) as error:
        _config(zero, make_registry(PLUGIN))
    assert message in str(error.value)


# ------------------------------------------------------------------ dsplug.testing.run_ranks
def _rank_and_world():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 refuses")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def test_run_ranks_names_the_rank_that_failed_and_refuses_local_functions():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed in _rank_and_world.*ValueError: rank 1 refuses"):
        run_ranks(_rank_and_world, 2)
    assert run_ranks(_rank_and_world, 1) == [(0, 1)]
    with pytest.raises(ValueError, match="not a module-level function"):
        run_ranks(lambda: 0, 2)
