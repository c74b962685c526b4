"""Communication volume, step time and model-state memory per rank at ZeRO stages 0-3, against the
ZeRO paper's analysis, at several world sizes.

    python benchmarks/comm_volume.py                       # worlds 2,4,8; ~3-5 min on 2 cores
    python benchmarks/comm_volume.py --worlds 2,4 --steps 4 --bf16
    python benchmarks/comm_volume.py --worlds 1 --bf16    # one GPU over NCCL (benchmarks/device_check.sh)

Each (world, stage) run trains the same MLP (``--width`` x ``--layers`` Linear layers, ~Ψ
parameters) for ``--steps`` optimizer steps over gloo on 127.0.0.1 (NCCL and the GPU where the
accelerator is CUDA; at world 1 nothing is sent and the ratio column shows "-") through ``dsplug.initialize``
and counts, with a ``dsplug_comm_op`` hook (the message sizes the comms logger reports), the
bytes each rank SENDS per optimizer step: message size x a per-op factor -- all-reduce 2(n-1)/n,
all-gather / reduce-scatter / all-to-all (n-1)/n (the comms logger's bus factors), reduce and
broadcast (n-1)/n (their per-rank average: n-1 ranks each send the message once, the root of a
reduce / the last rank of a broadcast none; the comms logger counts them 1x, the bus-bandwidth
convention), send 1, recv 0 -- the first step left out (stage 3 records its trace there). Ψ = parameter count x bytes of the
communication dtype (fp32, or 2 with --bf16).

The ZeRO paper's per-rank volume, with ring collectives moving (n-1)/n of the data per
reduce-scatter or all-gather: stage 0 all-reduce = reduce-scatter + all-gather = 2Ψ(n-1)/n;
stages 1-2 reduce-scatter the gradients and all-gather the parameters = 2Ψ(n-1)/n; stage 3
all-gathers the parameters twice (forward, backward) and reduce-scatters the gradients =
3Ψ(n-1)/n. ("2Ψ" / "3Ψ" in the paper is the large-n limit.)

At stages 1-2 dsplug reduce-scatters with one ``reduce`` per owner's segment of a bucket (the
segments are unequal, and gloo has no reduce-scatter): per rank that is (n-1)/n of the bucket,
as a reduce-scatter. Small extra collectives (gradient-norm and overflow all-reduces) show under
their op. The "x analysis" column is the ratio of what the comm layer saw to the analysis.

Memory: ``engine.stage.memory_breakdown()`` (parameters, gradients, optimizer states this rank
holds after the last backward, before its step) next to ``dsplug config explain``'s estimate (the ZeRO plugin's
``dsplug_estimate_model_state_bytes``) for the same config and world size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mlp import make_mlp  # noqa: E402
from _spawn import run as spawn_run  # noqa: E402

ANALYSIS = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}


def sent_factor(op: str, world: int) -> float:
    """Bytes this rank sends per byte of the logged message size (see the module docstring)."""
    n = max(1, world)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "broadcast"):
        return (n - 1) / n
    return 1.0 if op == "send" else 0.0


def _config(stage: int, micro: int, bf16: bool) -> Dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage}}
    if stage == 3:  # one gather per parameter per pass: the analysis' 2 all-gathers
        cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0,
                                        stage3_param_persistence_threshold=0)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _rank_run(stage: int, args) -> Dict[str, Any]:
    import dsplug
    dsplug.init_distributed()
    world = dsplug.comm.get_world_size()
    sent = {"bytes": 0.0, "ops": {}}

    class Listener:  # sees every collective through the dsplug_comm_op hook
        @dsplug.hookimpl
        def dsplug_comm_op(self, op, nbytes, world_size):
            moved = nbytes * sent_factor(op, world_size)
            sent["bytes"] += moved
            sent["ops"][op] = sent["ops"].get(op, 0.0) + moved

    listener = Listener()

    model = make_mlp(args.width, args.layers)
    engine, *_ = dsplug.initialize(model=model, config=_config(stage, args.micro, args.bf16))
    dtype = next(engine.module.parameters()).dtype
    gen = torch.Generator().manual_seed(engine.global_rank)
    per_step, times = [], []
    dsplug.comm.events.register(listener)
    try:
        for step in range(args.steps + 1):
            x = torch.randn(args.micro, args.width, generator=gen).to(device=engine.device, dtype=dtype)
            before = sent["bytes"]
            ops_before = dict(sent["ops"])
            start = time.perf_counter()
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            memory = engine.stage.memory_breakdown()  # with this step's gradients, before the step
            engine.step()
            engine.accelerator.synchronize()  # device work is asynchronous (a no-op on CPU)
            times.append(time.perf_counter() - start)
            if step > 0:
                per_step.append((sent["bytes"] - before,
                                 {k: v - ops_before.get(k, 0.0) for k, v in sent["ops"].items()}))
    finally:
        dsplug.comm.events.unregister(listener)
    numel = sum(p.numel() for p in model.parameters()) if stage < 3 else \
        sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    estimate = engine.config.registry.pm.hook.dsplug_estimate_model_state_bytes(
        num_params=numel, world_size=world, config=engine.config)
    ops: Dict[str, float] = {}
    for _, by_op in per_step:
        for k, v in by_op.items():
            ops[k] = ops.get(k, 0.0) + v / len(per_step)
    all_bytes = dsplug.comm.all_gather_object(statistics.mean(b for b, _ in per_step))
    all_times = dsplug.comm.all_gather_object(statistics.median(times[1:]))
    return {"numel": numel, "elem": 2 if args.bf16 else 4, "bytes": all_bytes, "ops": ops, "memory": memory,
            "estimate": estimate, "time": max(all_times)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args(argv)

    print(f"MLP {args.layers} x Linear({args.width}, {args.width}), micro-batch {args.micro}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {args.steps} measured steps; bytes SENT per rank per optimizer step")
    header = (f"{'world':>5} {'stage':>5} | {'sent/step':>12} {'x Psi':>7} {'analysis':>9} {'x analysis':>10} | "
              f"{'step ms':>8} | {'model-state MB':>14} {'estimate MB':>11} {'x est':>6} | by op")
    print(header)
    print("-" * len(header))
    for world in args.worlds:
        for stage in args.stages:
            r = spawn_run(_rank_run, world, stage, args)
            psi = r["numel"] * r["elem"]
            sent = statistics.mean(r["bytes"])
            analysis = ANALYSIS[stage] * (world - 1) / world
            mem = r["memory"]
            held = mem.get("parameters", 0) + mem.get("gradients", 0) + mem.get("optimizer_states", 0)
            est = r["estimate"]["device"]["total"] + r["estimate"]["host"]["total"]
            ops = ", ".join(f"{k} {v / psi:.2f}" for k, v in sorted(r["ops"].items()) if v)
            # at world 1 nothing goes to another rank: the analysis is 0 and there is no ratio
            versus = f"{sent / psi / analysis:>10.3f}" if analysis else f"{'-':>10}"
            print(f"{world:>5} {stage:>5} | {sent:>12,.0f} {sent / psi:>7.3f} {analysis:>9.3f} "
                  f"{versus} | {r['time'] * 1e3:>8.1f} | {held / 2 ** 20:>14.2f} "
                  f"{est / 2 ** 20:>11.2f} {held / est:>6.2f} | {ops}")
    if 1 in args.stages:
        print("stage 1: the estimate (the ZeRO paper's) counts full gradients, which stage 1 holds while "
              "gradients accumulate, until the boundary's reduction; measured after that reduction, only "
              "this rank's gradient partition is left (as at stage 2).")


if __name__ == "__main__":
    main()
