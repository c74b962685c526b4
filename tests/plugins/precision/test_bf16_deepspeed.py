"""bf16 under ZeRO against DeepSpeed 0.19.8 (tests/data/deepspeed/bf16_grad_norms.json, made by
tests/data/deepspeed/make_bf16_grad_norms.py in a separate DeepSpeed environment): with several
micro-steps per step DeepSpeed sums the micro-steps' gradients in bf16 (``data_types.grad_accum_dtype``
defaults to the model's dtype under ZeRO), which the gradient norm shows."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

import dsplug

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "deepspeed"
FIXTURE = json.loads((DATA / "bf16_grad_norms.json").read_text())
sys.path.insert(0, str(DATA))
try:
    import make_bf16_grad_norms as M
finally:
    sys.path.remove(str(DATA))


def test_the_fixture_comes_from_deepspeed_0_19_8():
    assert FIXTURE["deepspeed"] == "0.19.8" and set(FIXTURE["cases"]) == set(M.CASES)


@pytest.mark.parametrize("name", sorted(M.CASES))
def test_grad_norms_and_losses_equal_deepspeeds(name):
    ours, theirs = M.run(dsplug.initialize, name), FIXTURE["cases"][name]
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)


def test_accumulating_in_fp32_gives_another_norm():
    """What dsplug did before (fp32 accumulation by default): the first step's norm is 4.005630,
    DeepSpeed's 4.004455; data_types.grad_accum_dtype still chooses fp32 explicitly."""
    stage, gas = M.CASES["stage2_gas2"]
    config = M.config(stage, gas)
    config["data_types"] = {"grad_accum_dtype": "fp32"}
    model = M.make_model()
    engine, *_ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.precision.grad_accum_dtype == torch.float32
    for micro in range(gas):
        x, y = M.batch(0, micro)
        engine.backward(M.loss_fn(engine(x.to(torch.bfloat16)), y))
        engine.step()
    theirs = FIXTURE["cases"]["stage2_gas2"]["norms"][0]
    assert engine.get_global_grad_norm() == pytest.approx(4.00563, abs=2e-6)
    assert abs(engine.get_global_grad_norm() - theirs) > 1e-3


def test_bf16_accumulates_in_bf16_under_zero_and_in_fp32_without():
    for stage, expected in ((0, torch.float32), (1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16)):
        model = M.make_model()
        engine, *_ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=M.config(stage, 1))
        assert engine.precision.grad_accum_dtype == expected, stage
