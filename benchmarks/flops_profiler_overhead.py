"""Cost of counting: a profiled forward pass against the same forward pass unprofiled.

Baseline: ``model(x)`` with nothing installed. Measured: the same call between
``FlopsProfiler.start_profile()`` and ``stop_profile()`` (hooks on every module, torch functions
wrapped). Prints the ratio profiled / baseline (median of repeats) for a small transformer block
stack, where per-call overhead matters most, and for a larger one.

    python benchmarks/flops_profiler_overhead.py [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from dsplug.profiling.flops_profiler import FlopsProfiler


def transformer(d_model: int, layers: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).train()


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, d_model, layers, batch, seq in [("small", 64, 4, 2, 32), ("large", 256, 4, 8, 128)]:
        model = transformer(d_model, layers)
        x = torch.randn(batch, seq, d_model)
        with torch.no_grad():
            baseline = median_seconds(lambda: model(x), args.repeats)
            prof = FlopsProfiler(model)
            prof.start_profile()
            try:
                profiled = median_seconds(lambda: (prof.reset_profile(), model(x)), args.repeats)
                flops = prof.get_total_flops(as_string=True)
            finally:
                prof.end_profile()
        print(f"{name:>5}: baseline (plain forward) {baseline * 1e3:8.2f} ms | profiled {profiled * 1e3:8.2f} ms "
              f"| ratio profiled/baseline {profiled / baseline:5.2f}x | {flops}FLOPs per forward")


if __name__ == "__main__":
    main()
