"""What DeepSpeed 0.19.8's comms logger records at 1 rank, for tests/plugins/comms_logger/test_comms_logger.py.

DeepSpeed is a black box here, never a dependency: run this in a separate virtual environment
(see make_fixtures.py for its setup)::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \\
        tests/data/deepspeed/make_comms_log.py

For each case of ``CASES`` it builds make_fixtures.py's tiny model with ``comms_logger`` enabled
(``prof_all``, ``debug``) in one process over gloo, and writes to ``comms_log.json`` the logger's
records (``"<op> | [Caller Func: <function>]"`` -> message size in bytes -> count) right after
``initialize`` and after ``STEPS`` optimizer steps of ``GAS`` micro-steps. Everything the dsplug side needs is importable from this
file without DeepSpeed.
"""
from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures import IN, OUT, loss_fn, make_model  # noqa: E402

MICRO, GAS, STEPS = 4, 2, 2
#: name -> (zero stage, bf16)
CASES = {"stage0_fp32": (0, False), "stage1_fp32": (1, False), "stage2_fp32": (2, False), "stage2_bf16": (2, True),
         "stage3_fp32": (3, False), "stage3_bf16": (3, True)}


def config(stage: int, bf16: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
            "comms_logger": {"enabled": True, "prof_all": True, "debug": True}}


def batch(step: int, micro: int):
    g = torch.Generator().manual_seed(40_000 + 31 * step + micro)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, OUT, generator=g)


def train(engine, dtype) -> None:
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = batch(step, micro)
            engine.backward(loss_fn(engine(x.to(dtype)), y))
            engine.step()


def _ds_records(comms_logger) -> dict:
    return {name: {str(size): record[0] for size, record in sorted(sizes.items())}
            for name, sizes in sorted(comms_logger.comms_dict.items())}


def main():
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29583")
    import deepspeed
    from deepspeed.comm.comm import comms_logger

    deepspeed.init_distributed(dist_backend="gloo")
    out = {"deepspeed": deepspeed.__version__, "micro": MICRO, "gas": GAS, "steps": STEPS, "cases": {}}
    for name, (stage, bf16) in CASES.items():
        comms_logger.comms_dict.clear()
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, bf16))
        after_init = _ds_records(comms_logger)
        train(engine, torch.bfloat16 if bf16 else torch.float32)
        out["cases"][name] = {"after_initialize": after_init, "after_training": _ds_records(comms_logger)}
        engine.destroy()
    with open(os.path.join(HERE, "comms_log.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
