"""Pipeline parallelism: step time of 2 stages against the same model on 1 stage, and the
point-to-point bytes per step.

    python benchmarks/pipeline.py                          # d 1024, 8 Linear+ReLU blocks, 8 micro-batches of 32
    python benchmarks/pipeline.py --width 512 --micro-batches 4 --steps 5

One invocation trains the same ``PipelineModule`` (``--blocks`` Linear(d, d) layers with ReLU between,
MSE loss; ``seed_layers`` so both runs start from the same weights; AdamW, fp32,
ZeRO 0) on the same data through ``engine.train_batch``:

* ``1 stage``  -- one process (``--threads`` torch threads): the baseline;
* ``2 stages`` -- two processes over gloo on 127.0.0.1 (``--threads`` each), the layers split by
  parameter count (``--blocks`` / 2 Linears each), 1F1B over ``--micro-batches`` micro-batches.

The pair runs with 1 thread per process, and again with ``--threads`` when that is more.

After ``--warmup`` batches, ``--steps`` batches are timed (median of the slowest rank's
``train_batch``), with each rank's CPU time per step (``time.process_time``: on a machine with
fewer free cores than processes the wall time shows contention, the CPU time the work split) and
the time it spent blocked in ``recv`` (waiting for its neighbour: the pipeline bubble plus the
transfer). Every ``send`` / ``recv`` is counted through the ``dsplug_comm_op`` hook (on ``dsplug.comm.events``); the
bytes per step are those of the timed steps (the one-time meta message falls in the warm-up).
Expected per step: M x (micro-batch x d x 4 bytes) of activations forward and as many gradient
bytes back. The ideal 2-stage time with 1F1B on S stages and M micro-batches is
(M + S - 1) / (S x M) of the 1-stage time when the stages are balanced and the links free;
the printed ratios are the measured 2-stage time / the 1-stage time of the same invocation.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

from dsplug import hookimpl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _spawn import run as spawn_run  # noqa: E402


class P2PCounter:
    """A ``dsplug_comm_op`` hook: bytes and counts of point-to-point ops (and all the rest by op)."""

    def __init__(self):
        self.bytes = collections.Counter()
        self.count = collections.Counter()
        self.seconds = collections.Counter()

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, latency_s):
        self.bytes[op] += int(nbytes)
        self.count[op] += 1
        self.seconds[op] += latency_s  # a blocking recv: the time this stage waited for its peer


def layers(args):
    from torch import nn

    from dsplug.pipe import LayerSpec

    out = []
    for _ in range(args.blocks):
        out += [LayerSpec(nn.Linear, args.width, args.width), nn.ReLU()]
    return out[:-1]  # no ReLU after the last Linear


def data(args, steps):
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(args.micro_batch, args.width, generator=g), torch.randn(args.micro_batch, args.width,
                                                                                 generator=g))
             for _m in range(args.micro_batches)] for _s in range(steps)]


def _train(stages, args):
    import dsplug
    from dsplug import comm
    from dsplug.pipe import PipelineModule
    from torch import nn

    model = PipelineModule(layers(args), num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True)
    engine, *_ = dsplug.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10 ** 9})
    batches = data(args, args.warmup + args.steps)
    counter = P2PCounter()
    times, losses, cpu = [], [], 0.0
    for i, step in enumerate(batches):
        if i == args.warmup:
            comm.events.register(counter)
        comm.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(float(engine.train_batch(iter(step))))
        times.append(time.perf_counter() - start)
        if i >= args.warmup:
            cpu += time.process_time() - start_cpu
    comm.events.unregister(counter)
    timed = times[args.warmup:]
    slowest = comm.all_gather_object(timed)
    per_step = [max(column) for column in zip(*slowest)]
    sent = comm.all_gather_object(counter.bytes["send"] / args.steps)
    received = comm.all_gather_object(counter.bytes["recv"] / args.steps)
    params = comm.all_gather_object(sum(p.numel() for p in model.parameters()))
    cpu_s = comm.all_gather_object(cpu / args.steps)
    wait_s = comm.all_gather_object(counter.seconds["recv"] / args.steps)
    return {"median_s": statistics.median(per_step), "losses": losses, "sent": sent, "received": received,
            "parts": list(model.parts), "params": params, "cpu_s": cpu_s, "wait_s": wait_s}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (the 1-thread pair "
                        "always runs too)")
    args = parser.parse_args(argv)

    print(f"model: {args.blocks} x Linear({args.width}, {args.width}) with ReLU between, fp32, MSE; "
          f"{args.micro_batches} micro-batches of {args.micro_batch}; {args.steps} timed steps after {args.warmup}")
    runs = {}
    threads = sorted({args.threads, 1}, reverse=True)
    for t in threads:
        runs[("1 stage", t)] = spawn_run(_train, 1, 1, args, threads=t)
        runs[("2 stages", t)] = spawn_run(_train, 2, 2, args, threads=t)
    act = args.micro_batch * args.width * 4
    ideal = (args.micro_batches + 1) / (2 * args.micro_batches)
    print(f"{'run':<10} {'threads':>7} {'step s':>8} {'ratio':>6} {'cpu s/step/rank':>16} {'recv wait s':>12} "
          f"{'sent B/step/rank':>22} {'final loss':>11}")
    for t in threads:
        base = runs[("1 stage", t)]
        for name in ("1 stage", "2 stages"):
            r = runs[(name, t)]
            sent = "/".join(f"{s:,.0f}" for s in r["sent"])
            cpu = "/".join(f"{c:.3f}" for c in r["cpu_s"])
            wait = "/".join(f"{w:.3f}" for w in r["wait_s"])
            print(f"{name:<10} {t:>7} {r['median_s']:8.3f} {r['median_s'] / base['median_s']:6.2f} {cpu:>16} "
                  f"{wait:>12} {sent:>22} {r['losses'][-1]:11.6f}")
    two = runs[("2 stages", threads[0])]
    print(f"stage boundaries (2 stages): {two['parts']}; parameters per stage: "
          f"{' / '.join(f'{n:,}' for n in two['params'])} (1 stage: {runs[('1 stage', threads[0])]['params'][0]:,})")
    print(f"p2p per step: stage 0 sends {two['sent'][0]:,.0f} B (expected {args.micro_batches} x {act:,} = "
          f"{args.micro_batches * act:,} B of activations), stage 1 sends {two['sent'][1]:,.0f} B of gradients; "
          f"received {two['received'][0]:,.0f} / {two['received'][1]:,.0f} B")
    print(f"ideal 2-stage / 1-stage time with 1F1B (balanced stages, free links): (M + 1) / 2M = {ideal:.3f}")
    same = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(runs[("1 stage", threads[0])]["losses"],
                                                                      two["losses"]))
    print(f"losses of the 1-stage and 2-stage runs agree (rel 1e-4): {same}")


if __name__ == "__main__":
    main()
