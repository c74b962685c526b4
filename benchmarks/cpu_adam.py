"""dsplug cpu_adam against the memory-bandwidth bound and torch's fused AdamW, measured in one run.

Bytes an AdamW step moves per parameter (what the bound counts; read-for-ownership traffic is
not counted, and a step updates its buffers in place, so it has none):

* fp32 moments: read param, grad, exp_avg, exp_avg_sq (4 x 4 B), write param, exp_avg,
  exp_avg_sq (3 x 4 B) = 28 B.
* bf16 moments: read param and grad (2 x 4 B) and the two moments (2 x 2 B), write param
  (4 B) and the moments (2 x 2 B) = 20 B.

The bound is the machine's memory bandwidth measured in the same run over the same bytes
(28 B per parameter) with two reference streams, each counted as bytes read + bytes written:

* ``copy``: ``dst.copy_(src)`` of 14 B per parameter (14 read + 14 written; a plain copy also
  pays a read-for-ownership of ``dst`` the count leaves out, so it understates the bus);
* ``rmw``: ``b.add_(a)`` over the same two buffers (reads a and b, writes b in place: the
  read-modify-write pattern an optimizer step has, with no read-for-ownership).

The larger of the two in each round is the bound; a kernel's share is its bytes / time over that
bandwidth (1.0 = the memory bus is the limit). torch's fused AdamW (28 B/param, fp32 moments)
is timed beside. Candidates run interleaved (one call each per round) so load from other
processes hits them alike; shares and ratios are medians over rounds of in-round ratios.
Every group (size x moment dtype) allocates its own buffers and frees them before the next.

    python benchmarks/cpu_adam.py [--params 20000000,200000000] [--moments fp32,bf16] [--rounds 9]

Targets: share of the bound >= 0.9 at 20M and 200M, fp32 and bf16 moments; faster than torch
fused AdamW.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from dsplug.ops.adam import DeepSpeedCPUAdam

FUSED = "torch AdamW(fused=True)"
FOREACH = "torch AdamW(foreach=True)"
COPY = "copy: torch copy_ 14 B/param"
RMW = "rmw: torch add_ in place"
BYTES_PER_PARAM = {"fp32": 28, "bf16": 20}


def make_param(n: int, seed: int = 0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen)
    return p


def group(n: int, moments: str, hyper: dict, foreach: bool):
    """name -> (callable doing one step or one stream, bytes it moves)."""
    ours = f"dsplug cpu_adam ({moments} moments)"
    kwargs = {} if moments == "fp32" else {"moment_dtype": "bf16"}
    steps = {ours: (DeepSpeedCPUAdam([make_param(n)], **kwargs, **hyper).step, BYTES_PER_PARAM[moments] * n)}
    steps[FUSED] = (torch.optim.AdamW([make_param(n)], fused=True, **hyper).step, 28 * n)
    if foreach:
        steps[FOREACH] = (torch.optim.AdamW([make_param(n)], foreach=True, **hyper).step, 28 * n)
    elems = n * 14 // 4
    src, dst = torch.randn(elems), torch.randn(elems)
    steps[COPY] = (lambda: dst.copy_(src), 2 * 4 * elems)
    steps[RMW] = (lambda: dst.add_(src, alpha=1e-30), 3 * 4 * elems)
    return ours, steps


def run_group(n: int, moments: str, rounds: int, hyper: dict, foreach: bool):
    ours, steps = group(n, moments, hyper, foreach)
    times = {name: [] for name in steps}
    for round_ in range(rounds + 2):  # two warm-up rounds (first touch, thread pools)
        for name, (step, _) in steps.items():
            started = time.perf_counter()
            step()
            if round_ >= 2:
                times[name].append(time.perf_counter() - started)
    nbytes = {name: b for name, (_, b) in steps.items()}
    bound = [max(nbytes[COPY] / c, nbytes[RMW] / r) for c, r in zip(times[COPY], times[RMW])]  # B/s per round

    def share(name):
        return statistics.median(nbytes[name] / t / bw for t, bw in zip(times[name], bound))

    rows = []
    for name in steps:
        rows.append((name, min(times[name]), statistics.median(times[name]), nbytes[name] / n,
                     nbytes[name] / min(times[name]) / 1e9, share(name)))
    speedup = statistics.median(f / o for f, o in zip(times[FUSED], times[ours]))
    del steps
    gc.collect()
    return ours, rows, statistics.median(bound) / 1e9, speedup


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="20000000,200000000", help="comma-separated sizes")
    ap.add_argument("--moments", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--foreach", action="store_true", help="also time torch AdamW(foreach=True) (slow, 2x memory)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s.replace("_", "")) for s in args.params.split(",")]
    moment_kinds = [m.strip() for m in args.moments.split(",")]
    for m in moment_kinds:
        if m not in BYTES_PER_PARAM:
            ap.error(f"--moments: {m!r} is not one of {sorted(BYTES_PER_PARAM)}")
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    op = DeepSpeedCPUAdam([make_param(8)]).op
    isa = op.isa
    print(f"cpu_adam benchmark: {args.threads} thread(s) ({op.threads}), {args.rounds} interleaved rounds, "
          f"kernel ISA {isa}, "
          f"torch {torch.__version__}, load average at start {os.getloadavg()[0]:.2f}")
    summary = []
    for n in sizes:
        for moments in moment_kinds:
            ours, rows, bound_gbs, speedup = run_group(n, moments, args.rounds, hyper, args.foreach)
            print(f"\n{n:,} params, {moments} moments; bound (best of copy / rmw per round, median) "
                  f"{bound_gbs:.1f} GB/s; load average {os.getloadavg()[0]:.2f}")
            print(f"{'':38} {'best ms':>8} {'median ms':>10} {'B/param':>8} {'GB/s best':>10} {'share of bound':>15}")
            for name, best, med, bpp, gbs, sh in rows:
                print(f"{name:38} {best * 1e3:8.1f} {med * 1e3:10.1f} {bpp:8.0f} {gbs:10.2f} {sh:15.2f}")
            ours_share = next(r[5] for r in rows if r[0] == ours)
            summary.append((n, moments, bound_gbs, ours_share, speedup))
    print("\nsummary (target: share >= 0.90, faster than fused AdamW)")
    print(f"{'params':>12} {'moments':>8} {'bound GB/s':>11} {'dsplug share':>13} {'vs fused AdamW':>15}")
    for n, moments, bound_gbs, sh, sp in summary:
        print(f"{n:12,} {moments:>8} {bound_gbs:11.1f} {sh:13.2f} {sp:14.2f}x")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
