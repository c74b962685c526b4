"""Block-sparse attention (dsplug.ops.sparse_attention, native CPU op) against dense
``torch.nn.functional.scaled_dot_product_attention`` on CPU, at several sequence lengths.

Both compute self-attention on ``[batch, heads, seq, head_dim]`` fp32 tensors; the sparse one
only on the blocks of DeepSpeed's "fixed" layout (``FixedSparsityConfig``: local windows of
``num_local_blocks`` blocks plus one global block per window, bidirectional; DeepSpeed's
defaults), so it computes a different, cheaper function: the ratio of work is the layout's
density, printed per row. Measured per sequence length, in the same process:

* fwd+bwd: ``out = attn(q, k, v); out.backward(g)`` (q, k, v require grad);
* fwd: the forward alone under ``torch.no_grad()``;
* peak: the peak resident memory one fwd+bwd call adds over what was resident before it (the
  inputs), i.e. output, scores or tiles, saved tensors, gradients and the kernels' scratch.
  Measured in a fresh subprocess per candidate and length (Linux VmHWM, reset through
  /proc/self/clear_refs just before the call) with glibc told to return every freed block of
  64 KiB or more to the system (MALLOC_MMAP_THRESHOLD_), so resident memory follows what is
  live; the timed runs use the default allocator.

Candidates run interleaved (per round: each candidate once, in turn) so load from other
processes hits them alike; times are medians over the rounds, ratios are dense / sparse (> 1:
sparse is faster). ``--masked`` adds dense SDPA with the layout expanded to an explicit mask (the
same function as the sparse one, computed densely; torch's math path materializes the scores).

    python benchmarks/sparse_attention.py [--seq 1024 2048 4096 8192] [--block 16] [--batch 1]
        [--heads 8] [--head-dim 64] [--rounds 3] [--threads N] [--masked]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from dsplug.ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention, backend, native_available

SPARSE = "dsplug sparse (fixed)"
DENSE = "dense SDPA"
MASKED = "dense SDPA + layout mask"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_bytes(call) -> int:
    """Peak resident bytes ``call()`` adds (VmHWM after a reset, minus VmRSS before)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    call()
    return max(0, _status("VmHWM") - before)


def candidates(args, seq):
    cfg = FixedSparsityConfig(args.heads, block=args.block)
    sparse = SparseSelfAttention(cfg, max_seq_length=seq)
    layout = sparse.block_layout(seq)
    calls = {SPARSE: lambda q, k, v: sparse(q, k, v), DENSE: lambda q, k, v: F.scaled_dot_product_attention(q, k, v)}
    if args.masked:
        mask = layout.dense_mask()  # [heads, seq, seq] bool, True = attend
        calls[MASKED] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return calls, layout


def _inputs(args, seq):
    shape = (args.batch, args.heads, seq, args.head_dim)
    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(shape, generator=gen)


def _fwd_bwd(fn, q, k, v, grad):
    def call():
        out = fn(q, k, v)
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None
    return call


def probe_memory(args, name: str, seq: int) -> int:
    """In a fresh process: warm up on a short sequence, then the peak of one fwd+bwd at ``seq``."""
    args.masked = name == MASKED
    small = args.block * 8
    calls, _ = candidates(args, small)
    _fwd_bwd(calls[name], *_inputs(args, small))()  # thread pools, the native op
    calls, _ = candidates(args, seq)
    inputs = _inputs(args, seq)
    return peak_bytes(_fwd_bwd(calls[name], *inputs))


def measured_peak(args, name: str, seq: int) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", name, "--seq", str(seq), "--block", str(args.block),
           "--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe of {name} at {seq} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak"]


def run(args, seq):
    q, k, v, grad = _inputs(args, seq)
    calls, layout = candidates(args, seq)

    def fwd(fn):
        def call():
            with torch.no_grad():
                fn(q, k, v)
        return call

    times = {name: {"fb": [], "f": []} for name in calls}
    for fn in calls.values():  # warm-up: thread pools, first touch
        _fwd_bwd(fn, q, k, v, grad)()
    for _ in range(args.rounds):
        for name, fn in calls.items():
            for kind, call in (("fb", _fwd_bwd(fn, q, k, v, grad)), ("f", fwd(fn))):
                started = time.perf_counter()
                call()
                times[name][kind].append(time.perf_counter() - started)
    peaks = {name: measured_peak(args, name, seq) for name in calls}
    return times, peaks, layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--masked", action="store_true", help="also time dense SDPA with the layout as an explicit mask")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # internal: the memory probe's subprocess
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps({"peak": probe_memory(args, args.probe, args.seq[0])}))
        return 0
    if not native_available():
        print("note: the native sparse_attn op is not available here; the torch fallback runs", file=sys.stderr)
    print(f"sparse attention benchmark: batch {args.batch}, {args.heads} heads, head_dim {args.head_dim}, fp32, "
          f"fixed layout (block {args.block}, 4 local blocks, 1 global), {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds, {backend()}, torch {torch.__version__}")
    head = (f"{'seq':>6} {'density':>7}  {'':26} {'fwd+bwd ms':>11} {'fwd ms':>9} {'peak MiB':>9}  "
            f"{'fwd+bwd x':>9} {'fwd x':>7} {'mem x':>7}")
    print(head)
    for seq in args.seq:
        times, peaks, layout = run(args, seq)
        med = {n: {k: statistics.median(t) for k, t in kinds.items()} for n, kinds in times.items()}
        for name in times:
            ratio = (f"{med[DENSE]['fb'] / med[name]['fb']:9.2f} {med[DENSE]['f'] / med[name]['f']:7.2f} "
                     f"{peaks[DENSE] / max(peaks[name], 1):7.2f}") if name != DENSE else f"{'(baseline)':>25}"
            print(f"{seq:>6} {layout.density():7.3f}  {name:26} {med[name]['fb'] * 1e3:11.1f} "
                  f"{med[name]['f'] * 1e3:9.1f} {peaks[name] / 2 ** 20:9.1f}  {ratio}")
        sys.stdout.flush()
    print("ratios: dense SDPA / candidate (time: > 1 means the candidate is faster; mem: > 1 means it needs less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
