"""PlacedState: a CPU optimizer's state created in an offload device's storage steps exactly like
the state the optimizer creates itself, and stays in the device across a checkpoint load."""
from __future__ import annotations

import copy
import types

import pytest
import torch

from dsplug.ops.adagrad import DeepSpeedCPUAdagrad
from dsplug.ops.adam import DeepSpeedCPUAdam
from dsplug.plugins.offload.devices import CpuOffload
from dsplug.plugins.zero.partitioning.offload import PlacedState


def device():
    return CpuOffload(types.SimpleNamespace(pin_memory=False), types.SimpleNamespace(accelerator=None, rank=0))


def views(flat):
    return [flat[:7], flat[7:]]


@pytest.mark.parametrize("cls,options", [(DeepSpeedCPUAdam, {"weight_decay": 0.01}),
                                         (DeepSpeedCPUAdagrad, {"initial_accumulator_value": 0.3})])
def test_placed_state_steps_like_the_optimizers_own(cls, options):
    placed_params, own_params = views(torch.randn(20, generator=torch.Generator().manual_seed(0))), None
    own_params = [p.clone() for p in placed_params]
    placed, own = cls(placed_params, lr=0.1, **options), cls(own_params, lr=0.1, **options)
    state = PlacedState(device(), placed)
    assert len(state.stored) == len(cls.STATE_KEYS)  # one stored flat tensor per state
    for step in range(3):
        g = torch.randn(20, generator=torch.Generator().manual_seed(step + 1))
        for params in (placed_params, own_params):
            params[0].grad, params[1].grad = g[:7].clone(), g[7:].clone()
        placed.step()
        own.step()
    for a, b in zip(placed_params, own_params):
        assert torch.equal(a, b)
    for key in cls.STATE_KEYS:
        flat = state.tensors()[cls.STATE_KEYS.index(key)]
        assert torch.equal(flat, torch.cat([own.state[p][key] for p in own_params]))
        for p in placed_params:  # the optimizer's state is a view of the stored tensor
            assert placed.state[p][key].data_ptr() >= flat.data_ptr()


def test_rehome_keeps_loaded_state_in_the_device():
    params = views(torch.randn(20))
    optimizer = DeepSpeedCPUAdam(params, lr=0.1)
    state = PlacedState(device(), optimizer)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)  # torch makes new state tensors
    stored = state.tensors()[0]
    assert optimizer.state[params[0]]["exp_avg"].data_ptr() != stored.data_ptr()
    state.rehome()
    assert optimizer.state[params[0]]["exp_avg"].data_ptr() == stored.data_ptr()
    assert torch.equal(torch.cat([optimizer.state[p]["exp_avg"] for p in params]),
                       torch.cat([saved["state"][i]["exp_avg"] for i in (0, 1)]))
