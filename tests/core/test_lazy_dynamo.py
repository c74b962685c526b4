"""dsplug.lazy_dynamo: a training process never imports torch._dynamo unless something compiles,
and once something does, torch's own "dynamo disabled" methods take over as before."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import torch

from dsplug import lazy_dynamo

from tests.conftest import scaled

_TRAIN_WITHOUT_COMPILE = """
import json, sys, torch
import dsplug
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
engine, opt, _, _ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=cfg)
torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)  # a plain torch optimizer too
for _ in range(2):
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
torch_opt.zero_grad()
torch_opt.load_state_dict(torch_opt.state_dict())
engine.save_checkpoint(sys.argv[1])
engine.load_checkpoint(sys.argv[1])
print(json.dumps({"dynamo_imported": "torch._dynamo" in sys.modules}))
"""


def test_training_saving_and_loading_never_imports_dynamo(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _TRAIN_WITHOUT_COMPILE, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"dynamo_imported": False}, proc.stderr


def test_methods_run_directly_until_dynamo_is_imported_then_torchs_version_takes_over():
    """In this (pytest) process torch._dynamo may be imported already; the stand-in is exercised
    on a fresh wrapped function, with sys.modules controlled."""
    calls = []

    def state(self):
        calls.append(self)
        return "ran"

    wrapped = torch._disable_dynamo(state)

    class Owner:
        method = wrapped

    assert lazy_dynamo.install([Owner]) == 1
    stand_in = getattr(state, lazy_dynamo.CACHE_ATTR)
    assert isinstance(stand_in, lazy_dynamo._DisableOnDemand)
    saved = sys.modules.pop("torch._dynamo", None)
    try:
        assert Owner().method() == "ran"
        assert getattr(state, lazy_dynamo.CACHE_ATTR) is stand_in  # still direct: nothing imported dynamo
    finally:
        if saved is not None:
            sys.modules["torch._dynamo"] = saved
    importlib.import_module("torch._dynamo")  # what torch.compile does

    assert Owner().method() == "ran" and len(calls) == 2
    replaced = getattr(state, lazy_dynamo.CACHE_ATTR)
    assert not isinstance(replaced, lazy_dynamo._DisableOnDemand)  # torch's disabled version, cached as torch does
    assert lazy_dynamo.install([Owner]) == 1 and getattr(state, lazy_dynamo.CACHE_ATTR) is replaced  # idempotent


def test_a_compiled_step_calling_zero_grad_equals_eager():
    """torch.compile (eager backend: no C++ toolchain needed) of a training step that calls the
    optimizer's dynamo-disabled methods gives the eager result."""
    lazy_dynamo.install()

    def run(compiled: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            return loss

        fn = torch.compile(step, backend="eager") if compiled else step
        x = torch.arange(8.0).reshape(2, 4)
        for _ in range(3):
            fn(x)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_owners_without_wrapped_functions_change_nothing():
    class Plain:
        def method(self):
            return 1

    assert lazy_dynamo.install([Plain, json]) == 0
    assert Plain().method() == 1
