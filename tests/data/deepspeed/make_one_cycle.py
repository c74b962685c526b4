"""DeepSpeed 0.19.8's OneCycle schedule as numbers, for tests/plugins/schedulers/test_one_cycle_deepspeed.py.

DeepSpeed is a black box here, never a dependency: run this in a separate virtual environment
(see make_fixtures.py for its setup)::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \
        tests/data/deepspeed/make_one_cycle.py

It trains make_fixtures.py's tiny model (1 process, fp32, no ZeRO) with each config of
:data:`CASES` and writes ``one_cycle.json``: the lr and momentum (Adam's betas, SGD's momentum) of
the optimizer after ``initialize`` and after each step, those each optimizer step ran with, and the
loss of each step. Everything the
dsplug side needs (configs, the SGD optimizer) is importable from this file without DeepSpeed.
"""
from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_fixtures import GAS, GLOBAL_MICRO, loss_fn, make_model  # noqa: E402

#: DeepSpeed's documented OneCycle example (its config reference and 1Cycle tutorial)
DOCUMENTED = {"cycle_first_step_size": 1000, "cycle_first_stair_count": 500, "cycle_second_step_size": 1000,
              "cycle_second_stair_count": 500, "decay_step_size": 1000, "cycle_min_lr": 0.0001,
              "cycle_max_lr": 0.0010, "decay_lr_rate": 0.001, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99,
              "decay_mom_rate": 0.0}
#: a cycle short enough to run through: rise, fall, then decay of lr and momentum
SHORT = {"cycle_first_step_size": 4, "cycle_second_step_size": 6, "decay_step_size": 3, "cycle_min_lr": 0.001,
         "cycle_max_lr": 0.01, "decay_lr_rate": 0.5, "cycle_min_mom": 0.8, "cycle_max_mom": 0.95,
         "decay_mom_rate": 0.01}

#: name -> (optimizer: "adam" (config, torch's Adam) or "sgd" (a client torch.optim.SGD), scheduler params,
#: steps, gradient_clipping (None: not in the config))
CASES = {
    "documented_adam": ("adam", DOCUMENTED, 3, 0.0),
    "short_adam": ("adam", SHORT, 16, 0.0),
    "short_sgd": ("sgd", SHORT, 16, 0.0),
    "short_adam_no_momentum": ("adam", dict(SHORT, cycle_momentum=False), 6, 0.0),
    # no gradient_clipping key: DeepSpeed 0.19.8 then clips at 1.0 (its GRADIENT_CLIPPING_DEFAULT)
    "documented_adam_default_clipping": ("adam", DOCUMENTED, 3, None),
}


def config(optimizer: str, params: dict, clipping=0.0) -> dict:
    cfg = {"train_batch_size": GLOBAL_MICRO * GAS, "train_micro_batch_size_per_gpu": GLOBAL_MICRO,
           "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
           "scheduler": {"type": "OneCycle", "params": dict(params)}}
    if clipping is not None:
        cfg["gradient_clipping"] = clipping
    if optimizer == "adam":
        # weight_decay given: with torch_adam DeepSpeed leaves it to torch.optim.AdamW's default (0.01)
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "weight_decay": 0.0,
                                                       "torch_adam": True}}
    return cfg


def client_optimizer(optimizer: str, model):
    return torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9) if optimizer == "sgd" else None


def batch(step: int, micro: int):
    g = torch.Generator().manual_seed(20_000 + 31 * step + micro)
    from make_fixtures import IN, OUT

    return torch.randn(GLOBAL_MICRO, IN, generator=g), torch.randn(GLOBAL_MICRO, OUT, generator=g)


def state(optimizer) -> dict:
    group = optimizer.param_groups[0]
    momentum = list(group["betas"]) if "betas" in group else group.get("momentum")
    return {"lr": group["lr"], "momentum": momentum}


def run(initialize, name: str) -> dict:
    """Train case ``name`` with ``initialize`` (deepspeed's or dsplug's); what the fixture records."""
    optimizer_kind, params, steps, clipping = CASES[name]
    model = make_model()
    engine, optimizer, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                         optimizer=client_optimizer(optimizer_kind, model),
                                         config=config(optimizer_kind, params, clipping))
    record = {"initial": state(optimizer), "steps": [], "losses": [], "used": []}
    # the lr and momentum each optimizer step runs with
    base = getattr(optimizer, "optimizer", optimizer)
    base.register_step_pre_hook(lambda opt, args, kwargs: record["used"].append(state(opt)))
    for step in range(steps):
        total = 0.0
        for micro in range(GAS):
            x, y = batch(step, micro)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        record["losses"].append(total / GAS)
        record["steps"].append(state(optimizer))
    return record


def main():
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {"deepspeed": deepspeed.__version__, "cases": {name: run(deepspeed.initialize, name) for name in CASES}}
    with open(os.path.join(HERE, "one_cycle.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for name, record in out["cases"].items():
        print(name, record["initial"], record["steps"][-1], record["losses"][-1])


if __name__ == "__main__":
    main()
