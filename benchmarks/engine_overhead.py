"""Step time of dsplug (ZeRO stage 0) relative to a plain PyTorch DDP loop.

Same ~4M-parameter MLP, same torch.optim.AdamW(foreach=True), same data, 2 processes over gloo on
127.0.0.1, one thread each. Both are timed in the same process, alternating, after warm-up.

    python benchmarks/engine_overhead.py [--steps 30] [--world 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _mlp import make_mlp  # noqa: E402
from _spawn import run  # noqa: E402

WIDTH, LAYERS, BATCH = 1024, 4, 32


def make_model():
    return make_mlp(WIDTH, LAYERS)


def _time_steps(step, steps):
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(steps: int):
    import torch.distributed as dist

    import dsplug

    dsplug.init_distributed(verbose=False)
    x = torch.randn(BATCH, WIDTH)
    y = torch.randn(BATCH, WIDTH)

    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=True)

    def ddp_step():
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)

    engine, _, _, _ = dsplug.initialize(model=make_model(),
                                        optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4, foreach=True),
                                        config={"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9})

    def dsplug_step():
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()

    rounds = {"ddp": [], "dsplug": []}
    for _ in range(3):  # alternate to spread machine noise over both
        rounds["ddp"].append(_time_steps(ddp_step, steps))
        rounds["dsplug"].append(_time_steps(dsplug_step, steps))
        dist.barrier()
    params = sum(p.numel() for p in engine.module.parameters())
    return {k: min(v) for k, v in rounds.items()} | {"params": params}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    r = run(bench, args.world, args.steps)
    print(f"MLP {r['params'] / 1e6:.1f}M params, {args.world} processes (gloo), batch {BATCH}/rank, median step:")
    print(f"  baseline torch DDP + AdamW(foreach) : {r['ddp'] * 1e3:8.2f} ms")
    print(f"  dsplug stage 0 + AdamW(foreach)     : {r['dsplug'] * 1e3:8.2f} ms")
    print(f"  ratio dsplug / DDP                  : {r['dsplug'] / r['ddp']:.3f}x   (target <= 1.10x)")


if __name__ == "__main__":
    main()
