"""DeepSpeed 0.19.8's bf16 ZeRO gradient norms and losses, for tests/plugins/precision/test_bf16_deepspeed.py.

DeepSpeed is a black box here, never a dependency: run this in a separate virtual environment
(see make_fixtures.py for its setup)::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \
        tests/data/deepspeed/make_bf16_grad_norms.py

It trains make_fixtures.py's tiny model in bf16 (1 process, torch's AdamW, gradient clipping 1.0)
under ZeRO stages 1-3 with 1 and 2 micro-steps per step, and writes ``bf16_grad_norms.json``:
``engine.get_global_grad_norm()`` and the loss of each step. Everything the dsplug side needs is
importable from this file without DeepSpeed.
"""
from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures import IN, OUT, loss_fn, make_model  # noqa: E402

MICRO, STEPS = 8, 3
CASES = {f"stage{stage}_gas{gas}": (stage, gas) for stage in (1, 2, 3) for gas in (1, 2)}


def config(stage: int, gas: int) -> dict:
    return {"train_batch_size": MICRO * gas, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas, "gradient_clipping": 1.0, "steps_per_print": 1000,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}


def batch(step: int, micro: int):
    g = torch.Generator().manual_seed(30_000 + 31 * step + micro)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, OUT, generator=g)


def run(initialize, name: str) -> dict:
    stage, gas = CASES[name]
    model = make_model()
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config(stage, gas))
    out = {"norms": [], "losses": []}
    for step in range(STEPS):
        total = 0.0
        for micro in range(gas):
            x, y = batch(step, micro)
            loss = loss_fn(engine(x.to(torch.bfloat16)), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        out["losses"].append(total / gas)
        out["norms"].append(float(engine.get_global_grad_norm()))
    return out


def main():
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29581")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {"deepspeed": deepspeed.__version__, "cases": {name: run(deepspeed.initialize, name) for name in CASES}}
    with open(os.path.join(HERE, "bf16_grad_norms.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for name, record in out["cases"].items():
        print(name, record["norms"])


if __name__ == "__main__":
    main()
