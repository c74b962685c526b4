"""Step time with every monitor on (tensorboard, csv_monitor, wandb and comet offline, with
wall_clock_breakdown) relative to all off, on the ~4M-parameter MLP, one process.

Baseline: the very same engine with its monitor observers unregistered and the step timers off,
timed in the same process in alternating rounds (two separate engines differ by more than the
monitors cost, from memory placement alone). Target: <= 1.05x.

    python benchmarks/monitor_overhead.py [--steps 40] [--no-wandb] [--no-comet]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _mlp import make_mlp  # noqa: E402

WIDTH, LAYERS, BATCH = 1024, 4, 32


def make_model():
    return make_mlp(WIDTH, LAYERS)


def build(config):
    import dsplug

    engine, _, _, _ = dsplug.initialize(model=make_model(), config=config)
    return engine


def time_steps(engine, x, y, steps):
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--no-comet", action="store_true")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="dsplug-monitors-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", out)
    os.environ.setdefault("WANDB_SILENT", "true")
    base = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    monitors = {"wall_clock_breakdown": True,
                "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
                "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"}}
    enabled = ["tensorboard", "csv_monitor"]
    if not args.no_wandb and importlib.util.find_spec("wandb"):
        monitors["wandb"] = {"enabled": True, "project": "dsplug-bench"}
        enabled.append("wandb")
    if not args.no_comet and importlib.util.find_spec("comet_ml"):
        monitors["comet"] = {"enabled": True, "online": False,
                             "project": "dsplug-bench"}
        os.environ.setdefault("COMET_OFFLINE_DIRECTORY", out)
        enabled.append("comet")
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    engine = build({**base, **monitors})
    observers = list(engine.observers)

    def monitors_on(on: bool):
        engine.timers.enabled = on
        for observer in observers:
            if on and not engine.events.is_registered(observer):
                engine.events.register(observer)
            elif not on and engine.events.is_registered(observer):
                engine.events.unregister(observer)

    time_steps(engine, x, y, 5)
    rounds = {"off": [], "on": []}
    for _ in range(3):
        for mode in ("off", "on"):
            monitors_on(mode == "on")
            rounds[mode].append(time_steps(engine, x, y, args.steps))
    monitors_on(True)
    engine.destroy()
    t_off, t_on = min(rounds["off"]), min(rounds["on"])
    print(f"MLP {sum(p.numel() for p in engine.module.parameters()) / 1e6:.1f}M params, median step over "
          f"{args.steps} steps, best of 3 alternating rounds")
    print(f"  baseline, monitors off        : {t_off * 1e3:8.2f} ms")
    print(f"  monitors on ({', '.join(enabled)}): {t_on * 1e3:8.2f} ms")
    print(f"  ratio on / off                : {t_on / t_off:.3f}x   (target <= 1.05x)")


if __name__ == "__main__":
    main()
