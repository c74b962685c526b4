"""dsplug quantizer op (native) against its pure-torch fallback and a memcpy of the same bytes.

``quantize_dequantize(x, 8, groups, symmetric=True)`` on N fp32 values reads x twice (statistics,
then quantize; the second read hits the cache when a group fits in it) and writes N floats: the
memcpy baseline is ``x.clone()`` (N floats read + N written, including the allocation the
quantizer's output also pays), the bound a one-pass kernel can approach. Both functions are
called through the public entry points (``_native_quantize_dequantize`` /
``_torch_quantize_dequantize``), so the timings include the Python wrapper.

The candidates run interleaved (per round: one untimed then one timed call of each, so that one
candidate's freed temporaries do not decide where the next one's output lands), so load from
other processes hits them alike; each ratio is the median over rounds of the ratio within a
round. Above the allocator's reuse threshold (glibc: 32 MiB) every call's output is fresh memory
and page faults dominate the native call and the memcpy alike (see the 16M rows). torch's
OpenMP threads spin for a while after each torch op (the fallback, the clone), taking the cores
the native op's worker threads want; OMP_WAIT_POLICY=PASSIVE shows the kernel without that.

    python benchmarks/quantize.py [--sizes 4194304 16777216] [--groups 1 64] [--rounds 11] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dsplug.ops import quantize as Q

OURS = "dsplug native quantizer"
FALLBACK = "torch fallback"
MEMCPY = "memcpy: x.clone()"


def candidates(x: torch.Tensor, groups: int):
    return {
        OURS: lambda: Q._native_quantize_dequantize(x, 8, groups, True),
        FALLBACK: lambda: Q._torch_quantize_dequantize(x, 8, groups, True),
        MEMCPY: lambda: x.clone(),
    }


def run(n: int, groups: int, rounds: int):
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    calls = candidates(x, groups)
    assert torch.equal(calls[OURS]().view(torch.int32), calls[FALLBACK]().view(torch.int32))  # bitwise
    times = {name: [] for name in calls}
    for round_ in range(rounds + 2):  # two warm-up rounds (first touch, thread pools)
        for name, call in calls.items():
            call()  # untimed: settles the allocator after the previous candidate's temporaries
            started = time.perf_counter()
            call()
            if round_ >= 2:
                times[name].append(time.perf_counter() - started)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4 * 2 ** 20, 16 * 2 ** 20])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not Q.native_available():
        print("the native quantizer op is not available here (see `dsplug report`)", file=sys.stderr)
        return 1
    print(f"quantizer benchmark: 8-bit symmetric quantize_dequantize, fp32, {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds, {Q.backend()}, torch {torch.__version__}")
    print(f"{'N':>10} {'groups':>6}  {'':26} {'best ms':>8} {'median ms':>10} {'GB/s (8 B/elem)':>16}")
    for n in args.sizes:
        for groups in args.groups:
            times = run(n, groups, args.rounds)
            for name, t in times.items():
                best = min(t)
                print(f"{n:>10} {groups:>6}  {name:26} {best * 1e3:8.2f} {statistics.median(t) * 1e3:10.2f} "
                      f"{8 * n / best / 1e9:16.2f}")

            def ratio(a, b):  # median over rounds of time(a) / time(b), measured back to back
                return statistics.median(x / y for x, y in zip(times[a], times[b]))

            print(f"{'':>18}  native / torch fallback time: {ratio(OURS, FALLBACK):.3f} "
                  f"({ratio(FALLBACK, OURS):.1f}x faster); native / memcpy time: {ratio(OURS, MEMCPY):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
