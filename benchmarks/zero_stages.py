"""Step time of ZeRO stages 1, 2 (and 3 when installed) relative to stage 0, same run.

    python benchmarks/zero_stages.py                 # 2 processes over gloo, MLPs of ~4M and ~50M params
    python benchmarks/zero_stages.py --sizes 4M --steps 8 --threads 4

Each configuration trains an MLP (fp32 by default, AdamW) for a few warm-up steps, then times
``--steps`` optimizer steps; the figure is the median step time (slowest rank). The baseline is
stage 0 measured in the same processes. Stages 1/2 run three ways: DeepSpeed's defaults
(``overlap_comm`` off, one 5e8-element bucket, all-gather), "+overlap" (``overlap_comm`` on with
stage 0's 2**21-element buckets) and "+overlap +bcast" (also ``allgather_partitions: false``:
gloo's all-gather is several times slower than one broadcast per rank of the same bytes).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

SIZES = {"4M": (1024, 4), "50M": (2048, 12)}  # (width, layers): width*width*layers weights (+ biases)
OVERLAP = {"overlap_comm": True, "reduce_bucket_size": 2 ** 21}


def _mlp(width: int, layers: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.GELU())
    return torch.nn.Sequential(*mods)


def _variants(registry):
    variants = [("stage 0", {"stage": 0})]
    for stage in (1, 2):
        variants.append((f"stage {stage}", {"stage": stage}))
        variants.append((f"stage {stage} +overlap", {"stage": stage, **OVERLAP}))
        variants.append((f"stage {stage} +overlap +bcast", {"stage": stage, **OVERLAP, "allgather_partitions": False}))
    if registry.find("zero_stage", "3") is not None:
        variants.append(("stage 3", {"stage": 3}))
    return variants


def _time_steps(engine, width, batch, warmup, steps):
    import torch

    from dsplug import comm

    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(comm.get_rank()))
    x = x.to(engine.precision.model_dtype)
    times = []
    for i in range(warmup + steps):
        comm.barrier()
        start = time.perf_counter()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        comm.all_reduce(elapsed, op=comm.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    return statistics.median(times)


def _worker(rank, world, port, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(args.threads)
    import dsplug
    from dsplug.registry import get_registry

    rows = []
    for size in args.sizes:
        width, layers = SIZES[size]
        for round_index, (label, zero) in ((r, v) for r in range(args.rounds) for v in _variants(get_registry())):
            config = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10 ** 6,
                      "zero_optimization": zero}
            if args.precision != "fp32":
                config[args.precision] = {"enabled": True}
            model = _mlp(width, layers)
            params = sum(p.numel() for p in model.parameters())
            engine = dsplug.initialize(model=model, config=config,
                                       optimizer=lambda g: torch.optim.AdamW(g, lr=1e-4))[0]
            seconds = _time_steps(engine, width, args.batch, args.warmup, args.steps)
            engine.destroy()
            del engine, model
            rows.append((size, params, round_index, label, seconds))
    if rank == 0:
        queue.put(rows)
    import torch.distributed as dist

    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2,
                        help="repeat the whole sequence of variants; ratios are medians over rounds (load drifts)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    for size in args.sizes:
        if size not in SIZES:
            parser.error(f"--sizes: {size!r} is not one of {', '.join(SIZES)}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    print(f"ZeRO step time, {args.world} processes (gloo), {args.precision}, AdamW, batch {args.batch}/rank, "
          f"{args.threads} thread(s)/process; per round the median of {args.steps} steps, ratio to stage 0 of the "
          f"same round; median over {args.rounds} round(s)")
    print(f"{'model':>6} {'params':>12} {'variant':<24} {'ms/step':>9} {'vs stage 0':>10}   per round")
    baseline = {(size, r): sec for size, _, r, label, sec in rows if label == "stage 0"}
    seen = []
    for size, params, _, label, _ in rows:
        if (size, label) in seen:
            continue
        seen.append((size, label))
        mine = [(r, sec) for s, _, r, l, sec in rows if (s, l) == (size, label)]
        ratios = [sec / baseline[(size, r)] for r, sec in mine]
        per_round = " ".join(f"{x:.2f}" for x in ratios)
        print(f"{size:>6} {params:>12,} {label:<24} {statistics.median(sec for _, sec in mine) * 1e3:>9.1f} "
              f"{statistics.median(ratios):>9.2f}x   {per_round}")


if __name__ == "__main__":
    main()
