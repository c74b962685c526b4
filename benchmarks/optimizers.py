"""Step time of dsplug's FusedAdam against torch.optim.AdamW (foreach and fused) in one process.

    python benchmarks/optimizers.py                 # ~4M and ~50M parameters
    python benchmarks/optimizers.py --sizes 4 --steps 20 --device cuda

Parameters are laid out like transformer blocks (hidden x hidden matrices plus bias vectors), all
optimizers see the same gradients, and runs are interleaved in rounds so that machine noise hits
every candidate alike. Printed ratio = other step time / dsplug FusedAdam step time (> 1: dsplug faster). dsplug's
FusedAdam steps CPU fp32 parameters through the native cpu_adam op (the one under DeepSpeedCPUAdam,
timed as well), other devices and dtypes through torch's fused kernel where it exists; its torch-kernel
and foreach paths are timed as well.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsplug.accelerator import get_accelerator
from dsplug.ops.adam import DeepSpeedCPUAdam
from dsplug.plugins.optimizers.adam_optimizer import FusedAdam

HIDDEN = 1024


def make_params(millions: float, device):
    """Matrices of HIDDEN x HIDDEN with a bias each, about ``millions`` * 1e6 numbers in all."""
    count = max(1, round(millions * 1e6 / (HIDDEN * HIDDEN + HIDDEN)))
    shapes = [(HIDDEN, HIDDEN), (HIDDEN,)] * count
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(device) for s in shapes]


def foreach_only(params):
    optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    optimizer.use_fused_kernel = False
    return optimizer


def torch_kernel_only(params):
    optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    optimizer._native = False  # as without the native op: torch's fused kernel
    return optimizer


def candidates(fused_available: bool, device):
    out = {
        "dsplug FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
        "dsplug FusedAdam, torch kernel": torch_kernel_only,
        "dsplug FusedAdam, foreach path": foreach_only,
        "torch AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    }
    if fused_available:
        out["torch AdamW(fused=True)"] = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
    if device.type == "cpu":
        out["dsplug DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01)
    return out


def fused_supported(device) -> bool:
    try:
        p = torch.zeros(2, device=device, requires_grad=True)
        p.grad = torch.zeros(2, device=device)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


def bench(millions: float, steps: int, rounds: int, device) -> dict:
    accel = get_accelerator()
    template = make_params(millions, device)
    grads = [torch.randn_like(p) * 1e-2 for p in template]
    runs = {}
    for name, make in candidates(fused_supported(device), device).items():
        params = [p.clone().requires_grad_(True) for p in template]
        for p, g in zip(params, grads):
            p.grad = g  # shared: no optimizer here writes to gradients
        optimizer = make(params)
        for _ in range(3):  # warm-up: state allocation, first-call overheads
            optimizer.step()
        runs[name] = (optimizer, [])
    for _ in range(rounds):
        for name, (optimizer, times) in runs.items():
            accel.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            accel.synchronize()
            times.append((time.perf_counter() - start) / steps)
    numel = sum(p.numel() for p in template)
    return {"numel": numel, "tensors": len(template), **{n: statistics.median(t) for n, (_, t) in runs.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 50], help="millions of parameters")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    parser.add_argument("--device", default=None, help="default: the dsplug accelerator's device")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else get_accelerator().device()
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for millions in args.sizes:
        result = bench(millions, args.steps, args.rounds, device)
        ours = result["dsplug FusedAdam"]
        print(f"\n{result['numel'] / 1e6:.1f}M parameters in {result['tensors']} tensors "
              f"(median of {args.rounds} rounds x {args.steps} steps)")
        for name, seconds in result.items():
            if name in ("numel", "tensors"):
                continue
            ratio = "" if name == "dsplug FusedAdam" else f"   ratio {seconds / ours:.2f}x (this / dsplug)"
            print(f"  {name:31s} {seconds * 1e3:9.2f} ms/step{ratio}")


if __name__ == "__main__":
    main()
