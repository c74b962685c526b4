"""Reference checkpoints written by DeepSpeed, for tests/plugins/zero/test_deepspeed_interchange.py.

DeepSpeed is a baseline here, never a dependency: install it in a separate virtual environment
and run this script there (CPU only, no DeepSpeed ops are compiled: the optimizer is torch's AdamW)::

    python3 -m venv /work/dsvenv
    /work/dsvenv/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /work/dsvenv/bin/pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu /work/dsvenv/bin/python tests/data/deepspeed/make_fixtures.py make

``make`` trains the tiny model below with DeepSpeed for ``FIRST`` optimizer steps under each
configuration of ``FIXTURES`` (1 or 2 processes over gloo), saves a checkpoint into
``tests/data/deepspeed/<name>/``, resumes it in a fresh DeepSpeed engine and records the losses of
the next ``AFTER`` steps (and the trained parameters) in ``expected.json``. DeepSpeed's own
``zero_to_fp32.py`` / ``zero_to_torch.py`` scripts that it copies into the folder are deleted.

``resume`` is the other direction: DeepSpeed loads a checkpoint written by dsplug and prints the
losses of the next steps as JSON (tests/plugins/zero/test_deepspeed_interchange.py runs it when
``DSPLUG_DEEPSPEED_PYTHON`` names an interpreter with DeepSpeed)::

    DS_ACCELERATOR=cpu /work/dsvenv/bin/python tests/data/deepspeed/make_fixtures.py resume \
        --fixture s3_bf16_w2 --world 2 --load DIR [--steps 3] [--out FILE]

Everything the dsplug side needs (model, data, configs) is importable from this file without
DeepSpeed installed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
IN, HIDDEN, OUT = 8, 16, 4
GLOBAL_MICRO, GAS = 8, 2  # samples per micro-step over all ranks; micro-steps per step
FIRST, AFTER = 3, 3
CLIENT_STATE = {"epoch": 7, "note": "from deepspeed"}

#: name -> (zero stage, bf16, world size)
FIXTURES = {
    "s0_fp32_w1": (0, False, 1),
    "s0_bf16_w1": (0, True, 1),
    "s1_bf16_w2": (1, True, 2),
    "s2_fp32_w2": (2, False, 2),
    "s3_fp32_w2": (3, False, 2),
    "s3_bf16_w2": (3, True, 2),
}


def config(stage: int, bf16: bool, world: int) -> dict:
    """The DeepSpeed config of a fixture (dsplug reads the same JSON)."""
    return {
        "train_batch_size": GLOBAL_MICRO * GAS,
        "train_micro_batch_size_per_gpu": GLOBAL_MICRO // world,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }


def make_model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def global_batch(step: int, micro: int, size: int):
    """The whole data-parallel batch of micro-step ``micro`` of optimizer step ``step``."""
    g = torch.Generator().manual_seed(10_000 + 31 * step + micro)
    return torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)


def loss_fn(out, y):
    return ((out.float() - y) ** 2).mean()


def train(engine, steps: int, rank: int, world: int, dtype, all_reduce):
    """Losses (mean over micro-steps and ranks) of ``steps`` optimizer steps. Every run uses the same
    global batch of ``GLOBAL_MICRO`` samples per micro-step, split over its ranks, so a run at
    another world size computes the same averaged gradients."""
    size = GLOBAL_MICRO
    share = size // world
    losses = []
    for _ in range(steps):
        step, total = engine.global_steps, 0.0
        for m in range(GAS):
            x, y = global_batch(step, m, size)
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            loss = loss_fn(engine(x.to(dtype)), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        t = torch.tensor([total / GAS])
        all_reduce(t)
        losses.append(float(t) / world)
    return losses


# ------------------------------------------------------------------------------ DeepSpeed side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ds_engine(cfg):
    import deepspeed

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _ds_child(rank, world, port, job, result_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    stage, bf16, saved_world = FIXTURES[job["fixture"]]
    cfg = config(stage, bf16, world)
    dtype = torch.bfloat16 if bf16 else torch.float32

    def all_reduce(t):
        dist.all_reduce(t)

    out = {}
    if job["mode"] == "make":
        engine = _ds_engine(cfg)
        out["before"] = train(engine, FIRST, rank, world, dtype, all_reduce)
        engine.save_checkpoint(job["dir"], client_state=dict(CLIENT_STATE))
        del engine
    engine = _ds_engine(cfg)
    path, client = engine.load_checkpoint(job["dir"])
    out["loaded"] = path is not None
    out["global_steps"] = engine.global_steps
    out["lr"] = engine.get_lr()[0]
    out["client_state"] = {k: client[k] for k in CLIENT_STATE if k in client} if client else {}
    out["after"] = train(engine, job["steps"], rank, world, dtype, all_reduce)
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    else:
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    out["param_sums"] = {n: float(p.double().sum()) for n, p in params.items()}
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    dist.barrier()


def _run_deepspeed(job, world):
    import torch.multiprocessing as mp

    result_path = os.path.join(job["dir"], ".result.json")
    os.makedirs(job["dir"], exist_ok=True)
    mp.spawn(_ds_child, args=(world, _free_port(), job, result_path), nprocs=world)
    with open(result_path) as f:
        out = json.load(f)
    os.unlink(result_path)
    return out


def make(names):
    expected_path = os.path.join(HERE, "expected.json")
    expected = {}
    if os.path.exists(expected_path):
        with open(expected_path) as f:
            expected = json.load(f)
    import deepspeed

    for name in names:
        stage, bf16, world = FIXTURES[name]
        target = os.path.join(HERE, name)
        if os.path.exists(target):
            shutil.rmtree(target)
        out = _run_deepspeed({"mode": "make", "fixture": name, "dir": target, "steps": AFTER}, world)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's code: not ours to ship
            if os.path.exists(os.path.join(target, script)):
                os.unlink(os.path.join(target, script))
        expected[name] = {"stage": stage, "bf16": bf16, "world_size": world, "config": config(stage, bf16, world),
                          "deepspeed_version": deepspeed.__version__, "first_steps": FIRST, **out}
        print(name, json.dumps(expected[name]["after"]))
    with open(expected_path, "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


def resume(fixture, world, load_dir, steps, out_file):
    out = _run_deepspeed({"mode": "resume", "fixture": fixture, "dir": load_dir, "steps": steps}, world)
    text = json.dumps(out)
    if out_file:
        with open(out_file, "w") as f:
            f.write(text)
    print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make", help="write the DeepSpeed fixtures and expected.json")
    p.add_argument("names", nargs="*", default=list(FIXTURES))
    p = sub.add_parser("resume", help="DeepSpeed resumes a checkpoint (e.g. one dsplug wrote)")
    p.add_argument("--fixture", required=True, choices=list(FIXTURES))
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--load", required=True)
    p.add_argument("--steps", type=int, default=AFTER)
    p.add_argument("--out")
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.names)
    else:
        resume(args.fixture, args.world, args.load, args.steps, args.out)


if __name__ == "__main__":
    sys.exit(main())
