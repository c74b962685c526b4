"""ZeRO++ (qwZ / qgZ / hpZ) against plain ZeRO stage 3: bytes on the wire, loss, step time.

    python benchmarks/zeropp.py                      # 2 processes over gloo, an MLP of ~4.2M params, fp32
    python benchmarks/zeropp.py --model lm --steps 20

Every configuration trains the same model from the same initial weights on one fixed batch per
rank (AdamW, fp32) in the same 2 processes. After ``--warmup`` steps, one optimizer step is
recorded through the ``dsplug_comm_op`` hook (on ``dsplug.comm.events``): the bytes of every collective (the comm layer's
message size: an all-gather's whole output, a reduce-scatter's / all-to-all's whole input) summed
per op, as rank 0 sees them. Then ``--steps`` more steps are timed (median, slowest rank). The
loss is the mean over ranks after all steps. Ratios are against the named baseline "stage 3"
(bytes: baseline / config, so higher is better; time: config / baseline).

``stage3_max_reuse_distance: 0`` makes every module gather its parameters again for its backward,
as in a model too large to keep them (the default keeps them between forward and backward in a
model this small, and then hpZ has nothing to do); ``stage3_param_persistence_threshold: 0``
partitions every parameter. With 2 processes hpZ's group (k = 2) is the whole world: it changes
where the backward gathers come from, not how many bytes they move.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from dsplug import hookimpl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
VARIANTS = [
    ("stage 3", {}),
    ("stage 3 +qwZ", {"zero_quantized_weights": True}),
    ("stage 3 +qgZ", {"zero_quantized_gradients": True}),
    ("stage 3 +qwZ +qgZ", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
    ("stage 3 +qwZ +qgZ +hpZ(2)", {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                   "zero_hpz_partition_size": 2}),
]


class _Bytes:
    def __init__(self):
        self.by_op = {}

    @hookimpl
    def dsplug_comm_op(self, op, nbytes):
        self.by_op[op] = self.by_op.get(op, 0) + nbytes


def _model_and_batch(kind: str, width: int, layers: int, batch: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    if kind == "lm":
        from dsplug.plugins.train.model import CharTransformer, ModelConfig

        torch.manual_seed(0)
        config = ModelConfig(vocab_size=96, seq_len=64, d_model=width, n_layers=layers, n_heads=4)
        model = CharTransformer(config)
        tokens = torch.randint(0, 96, (batch, 65), generator=g)

        def loss_of(engine):
            logits = engine(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

        return model, loss_of
    from _mlp import make_mlp

    model = make_mlp(width, layers)
    x = torch.randn(batch, width, generator=g)
    teacher = torch.randn(width, width, generator=torch.Generator().manual_seed(7)) / width ** 0.5
    y = torch.tanh(x @ teacher)

    def loss_of(engine):
        return (engine(x) - y).pow(2).mean()

    return model, loss_of


def _worker(args):
    import torch

    import dsplug
    from dsplug import comm

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    results = []
    for name, extra in VARIANTS:
        model, loss_of = _model_and_batch(args.model, args.width, args.layers, args.batch, rank)
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
                  "zero_optimization": {**BASE, **extra}}
        engine, *_ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step():
            loss = loss_of(engine)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        first = step().reshape(1).clone()
        comm.all_reduce(first)
        for _ in range(args.warmup - 1):
            step()
        listener = _Bytes()
        comm.events.register(listener)
        try:
            step()
        finally:
            comm.events.unregister(listener)
        times = []
        for _ in range(args.steps):
            comm.barrier()
            start = time.perf_counter()
            loss = step()
            elapsed = torch.tensor([time.perf_counter() - start])
            comm.all_reduce(elapsed, op=comm.ReduceOp.MAX)
            times.append(float(elapsed))
        loss = loss.reshape(1).clone()
        comm.all_reduce(loss)
        results.append({"name": name, "bytes": listener.by_op, "loss": float(loss) / world,
                        "first_loss": float(first) / world,
                        "step_s": statistics.median(times), "steps": args.warmup + 1 + args.steps,
                        "params": sum(p.ds_numel for p in engine.module.parameters())})
        engine.destroy()
    return results


def _print(results, world):
    base = next(r for r in results if r["name"] == "stage 3")
    total = lambda r: sum(r["bytes"].values())  # noqa: E731
    print(f"{base['params'] / 1e6:.2f}M parameters, {world} processes (gloo), fp32, AdamW; loss at step 1 -> after "
          f"{base['steps']} steps; baseline \"stage 3\"")
    header = (f"{'config':<27} {'bytes/step/rank':>15} {'vs stage 3':>10}  {'all_gather':>10} {'grad reduce':>11} "
              f"{'loss':>17} {'step ms':>8} {'time vs stage 3':>15}")
    print(header)
    print("-" * len(header))
    for r in results:
        by = r["bytes"]
        grads = by.get("reduce_scatter", 0) + by.get("all_to_all_single", 0)
        print(f"{r['name']:<27} {total(r):>15,d} {total(base) / total(r):>9.2f}x  {by.get('all_gather', 0):>10,d} "
              f"{grads:>11,d} {r['first_loss']:>7.4f} -> {r['loss']:.4f} {r['step_s'] * 1e3:>8.1f} "
              f"{r['step_s'] / base['step_s']:>14.2f}x")
    print("(bytes: the comm layer's message sizes, one optimizer step after warm-up, rank 0; grad reduce = "
          "reduce_scatter or qgZ's all_to_all_single; the rest is the gradient norm's all_reduce)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "lm"), default="mlp")
    parser.add_argument("--width", type=int, default=None, help="MLP width / LM d_model (default 1024 / 256)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="samples (sequences) per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the recorded one (>= 1)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args(argv)
    args.warmup = max(1, args.warmup)
    if args.width is None:
        args.width = 1024 if args.model == "mlp" else 256
    from _spawn import run

    _print(run(_worker, args.world, args, threads=args.threads), args.world)


if __name__ == "__main__":
    main()
