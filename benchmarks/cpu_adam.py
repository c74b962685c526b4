"""dsplug cpu_adam step time against torch's AdamW and a memcpy of the same traffic, in one run.

One AdamW step over N fp32 parameters reads param, grad, exp_avg, exp_avg_sq and writes param,
exp_avg, exp_avg_sq: 7 x 4 = 28 bytes per parameter cross the memory bus. The memcpy baseline is
``dst.copy_(src)`` of 14 bytes per parameter (14 read + 14 written = the same 28 bytes moved),
the bound a one-pass kernel can approach; glibc's memcpy of the same bytes (one thread,
non-temporal stores that skip the read-for-ownership) is printed as a stricter reference. Also
times bf16 moments (20 bytes per parameter).

The candidates run interleaved (one step of each per round), so load from other processes hits
them alike; each ratio is the median over rounds of the ratio within a round.

    python benchmarks/cpu_adam.py [--params 50_000_000] [--rounds 11] [--threads N]

Targets: faster than torch fused AdamW, within 5% of the memcpy bound, bf16 moments >= 1.25x.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from dsplug.ops.adam import DeepSpeedCPUAdam

OURS = "dsplug cpu_adam (fp32 moments)"
OURS_BF16 = "dsplug cpu_adam (bf16 moments)"
FUSED = "torch AdamW(fused=True)"
FOREACH = "torch AdamW(foreach=True)"
MEMCPY = "memcpy bound: torch copy_ of 14 B/param"
GLIBC = "glibc memcpy of 14 B/param (1 thread)"


def make_param(n: int, seed: int = 0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen)
    return p


def candidates(n: int, hyper: dict):
    """name -> zero-argument callable doing one step (or one copy)."""
    steps = {
        OURS: DeepSpeedCPUAdam([make_param(n)], **hyper).step,
        OURS_BF16: DeepSpeedCPUAdam([make_param(n)], moment_dtype="bf16", **hyper).step,
        FUSED: torch.optim.AdamW([make_param(n)], fused=True, **hyper).step,
        FOREACH: torch.optim.AdamW([make_param(n)], foreach=True, **hyper).step,
    }
    elems = n * 14 // 4  # 14 bytes copied = 14 read + 14 written: an Adam step's 28 bytes
    src, dst = torch.randn(elems), torch.empty(elems)
    steps[MEMCPY] = lambda: dst.copy_(src)
    src2, dst2 = torch.randn(elems), torch.empty(elems)
    steps[GLIBC] = lambda: ctypes.memmove(dst2.data_ptr(), src2.data_ptr(), elems * 4)
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=50_000_000)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.params
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    steps = candidates(n, hyper)
    times = {name: [] for name in steps}
    for round_ in range(args.rounds + 2):  # two warm-up rounds (first touch, thread pools)
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_ >= 2:
                times[name].append(time.perf_counter() - started)
    best = {name: min(t) for name, t in times.items()}
    base = best[OURS]
    isa = DeepSpeedCPUAdam([make_param(8)]).op.isa
    print(f"cpu_adam benchmark: {n:,} fp32 params, {args.threads} thread(s), {args.rounds} interleaved rounds, "
          f"kernel ISA {isa}, torch {torch.__version__}")
    print(f"{'':44} {'best ms':>8} {'median ms':>10} {'GB/s (28 B/param)':>18} {'best / dsplug fp32':>19}")
    for name in steps:
        print(f"{name:44} {best[name] * 1e3:8.1f} {statistics.median(times[name]) * 1e3:10.1f} "
              f"{28 * n / best[name] / 1e9:18.2f} {best[name] / base:18.2f}x")
    def ratio(a, b):  # median over rounds of time(a) / time(b), measured back to back
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"dsplug vs torch fused AdamW: {ratio(FUSED, OURS):.2f}x faster (target > 1); "
          f"vs foreach: {ratio(FOREACH, OURS):.2f}x faster")
    print(f"dsplug vs memcpy bound (torch copy_): {ratio(OURS, MEMCPY):.3f}x its time (target <= 1.05); "
          f"vs glibc memcpy: {ratio(OURS, GLIBC):.3f}x")
    print(f"bf16 moments vs fp32 moments: {ratio(OURS, OURS_BF16):.2f}x faster (target >= 1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
