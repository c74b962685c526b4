"""Mixture of Experts vs the equivalent dense model on the `dsplug train` char LM, 2 processes.

    python benchmarks/moe.py                      # 2 processes over gloo, 60 steps (~2-3 min on 2 cores)
    python benchmarks/moe.py --steps 30 --experts 8 --only dense,ep2-top1

One invocation trains the built-in character transformer (plugins/train: CharTransformer, the
built-in corpus and its held-out split) on ``--world`` processes (gloo, 127.0.0.1, ``--threads``
torch threads each), ZeRO stage 0, fp32, every run from the same seed with the same data order
and number of steps, through ``dsplug.initialize`` and ``engine(x)`` / ``engine.backward`` /
``engine.step``, with the built-in config (AdamW, WarmupCosineLR; ``gradient_clipping`` removed:
see docs/moe.md). Runs:

* ``dense``     -- the model as it is: every block's FFN is d -> 4d -> d (the baseline);
* ``ep1-top1``  -- every block's FFN replaced by ``MoE(d, that FFN, num_experts=E, ep_size=1,
  k=1)``: E experts of the dense FFN's size on every rank, no all-to-all;
* ``ep2-top1``  -- the same with ``ep_size=2``: E/2 experts per rank, tokens exchanged by
  all-to-all over the expert-parallel group;
* ``ep2-top2``  -- ``ep_size=2``, ``k=2`` (twice the expert compute per token).

The MoE loss adds ``--aux-coeff`` x the layers' ``l_aux``. Every collective of every rank is
counted through the ``dsplug_comm_op`` hook (on ``dsplug.comm.events``): per rank and optimizer step, the all-to-all message
bytes (the input of each ``all_to_all_single``, the comms logger's message size) and the bytes on
the wire (message x the comms logger's bus factor (n-1)/n), and the all-reduce bytes (the
gradient averaging of stage 0). Step time: forward + backward + step of the slowest rank, median
over the steps after ``--warmup``. Ratios are to ``dense`` in the same invocation. The held-out
loss is rank 0's final model in eval mode (eval_capacity_factor), on the built-in held-out text.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

from dsplug import hookimpl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _builtin_lm import builtin_lm_config  # noqa: E402
from _spawn import run as spawn_run  # noqa: E402

RUNS = {"dense": None, "ep1-top1": dict(ep_size=1, k=1), "ep2-top1": dict(ep_size=2, k=1),
        "ep2-top2": dict(ep_size=2, k=2)}


class ByteCounter:
    """A ``dsplug_comm_op`` hook: message bytes and on-wire bytes (message x bus factor) per op."""

    def __init__(self):
        from dsplug.plugins.comms_logger.logger import bus_factor

        self.bus_factor = bus_factor
        self.message: collections.Counter = collections.Counter()
        self.wire: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, world_size):
        self.message[op] += int(nbytes)
        self.wire[op] += nbytes * self.bus_factor(op, world_size)
        self.calls[op] += 1

    def snapshot(self):
        return collections.Counter(self.message), collections.Counter(self.wire), collections.Counter(self.calls)


class MoEFeedForward(torch.nn.Module):
    """A block's FFN as a MoE layer; keeps the layer's ``l_aux`` for the loss."""

    def __init__(self, d_model: int, ffn: torch.nn.Module, experts: int, ep_size: int, k: int, capacity: float):
        super().__init__()
        from dsplug.moe.layer import MoE

        self.moe = MoE(d_model, ffn, num_experts=experts, ep_size=ep_size, k=k, capacity_factor=capacity,
                       eval_capacity_factor=capacity)
        self.l_aux = None

    def forward(self, x):
        out, self.l_aux, _ = self.moe(x)
        return out


def build_model(args, vocab_size: int, moe: Dict[str, int] = None):
    from dsplug.plugins.train.model import CharTransformer, ModelConfig

    torch.manual_seed(args.seed)
    model = CharTransformer(ModelConfig(vocab_size=vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                                        n_layers=args.layers, n_heads=args.heads))
    if moe is not None:
        for block in model.blocks:
            block.mlp = MoEFeedForward(args.d_model, block.mlp, args.experts, moe["ep_size"], moe["k"],
                                       args.capacity_factor)
    return model


def _aux_loss(model) -> torch.Tensor:
    terms = [m.l_aux for m in model.modules() if isinstance(m, MoEFeedForward) and m.l_aux is not None]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def _train_one(name: str, data, args) -> Dict[str, Any]:
    import dsplug
    from dsplug import comm
    from dsplug.plugins.train.data import batches_from, held_out_loss
    from dsplug.plugins.train.model import next_token_loss

    model = build_model(args, len(data["vocab"]), RUNS[name])
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            m.moe.set_deepspeed_parallelism()
    config = builtin_lm_config(args.micro_batch, args.seed, args.steps)
    config["zero_optimization"] = {"stage": 0}
    config.pop("gradient_clipping", None)
    engine, _, loader, _ = dsplug.initialize(model=model, training_data=data["dataset"], config=config)
    batches = batches_from(loader, 0)
    counter = ByteCounter()
    comm.events.register(counter)
    per_step = []
    try:
        engine.train()
        while engine.global_steps < args.steps:
            x, y = next(batches)
            before = counter.snapshot()
            start = time.perf_counter()
            loss = next_token_loss(engine(x), y)
            if RUNS[name] is not None:
                loss = loss + args.aux_coeff * _aux_loss(engine.module)
            engine.backward(loss)
            engine.step()
            seconds = time.perf_counter() - start
            after = counter.snapshot()
            per_step.append((after[0] - before[0], after[1] - before[1], after[2] - before[2], seconds))
    finally:
        comm.events.unregister(counter)
    times = torch.tensor([s[3] for s in per_step], dtype=torch.float64)
    comm.all_reduce(times, op=comm.ReduceOp.MAX)
    # the dense replicas must agree across ranks (experts differ by design under expert parallelism)
    dense = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters() if getattr(p, "allreduce", True)])
    high, low = dense.clone(), dense.clone()
    comm.all_reduce(high, op=comm.ReduceOp.MAX)
    comm.all_reduce(low, op=comm.ReduceOp.MIN)
    engine.module.eval()
    with torch.no_grad():
        held = held_out_loss(engine.module, data["held_tokens"], args.seq_len, args.micro_batch)
    params_here = sum(p.numel() for p in engine.module.parameters())
    experts = sum(p.numel() for p in engine.module.parameters() if not getattr(p, "allreduce", True))
    total = torch.tensor([float(experts)])
    comm.all_reduce(total)
    dense_count = sum(p.numel() for p in engine.module.parameters() if getattr(p, "allreduce", True))
    ep = RUNS[name]["ep_size"] if RUNS[name] else 1
    engine.destroy()
    return {"name": name, "per_step": [(dict(m), dict(w), dict(c), float(t)) for (m, w, c, _), t in
                                       zip(per_step, times)],
            "held_out": held, "rank_diff": float((high - low).abs().max()), "params_rank": params_here,
            "params_total": dense_count + int(total.item()) // (comm.get_world_size() // ep)}


def bench(args) -> List[Dict[str, Any]]:
    import dsplug
    from dsplug.plugins.train.data import CharVocab, CharWindows, read_builtin_corpus, split_tokens

    dsplug.init_distributed(verbose=False)
    text = read_builtin_corpus()
    vocab = CharVocab.of_text(text)
    tokens = torch.tensor(vocab.encode(text), dtype=torch.long)
    train_tokens, held_tokens = split_tokens(tokens, args.seq_len)
    data = {"vocab": vocab, "dataset": CharWindows(train_tokens, args.seq_len), "held_tokens": held_tokens}
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for name in args.only:
        results.append(_train_one(name, data, args))
        if rank == 0:
            print(f"  {name}: done", flush=True)
    return results


def summarise(result: Dict[str, Any], args) -> Dict[str, float]:
    steps = result["per_step"]
    timed = [s[3] for s in steps[args.warmup:]] or [s[3] for s in steps]

    def per_step(index: int, op: str) -> float:
        return statistics.fmean(s[index].get(op, 0) for s in steps)

    return {"ms": statistics.median(timed) * 1e3, "a2a_msg": per_step(0, "all_to_all_single"),
            "a2a_wire": per_step(1, "all_to_all_single"), "a2a_calls": per_step(2, "all_to_all_single"),
            "ar_wire": per_step(1, "all_reduce")}


def report(results: List[Dict[str, Any]], args) -> None:
    print()
    print(f"character transformer: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context "
          f"{args.seq_len}; MoE runs: every block's FFN (d -> 4d -> d) -> {args.experts} experts of that size, "
          f"capacity_factor {args.capacity_factor}, l_aux coefficient {args.aux_coeff}")
    print(f"{args.world} processes (gloo), {args.threads} thread(s) each, ZeRO stage 0, fp32, AdamW + WarmupCosineLR; "
          f"{args.steps} steps x {args.micro_batch} sequences per rank ({args.micro_batch * args.seq_len} tokens); "
          f"step time = median of the slowest rank over steps {args.warmup}..{args.steps - 1}")
    print()
    base = summarise(next(r for r in results if r["name"] == "dense"), args) if any(
        r["name"] == "dense" for r in results) else None
    print(f"{'run':<10}{'params':>11}{'per rank':>11}{'ms/step':>9}{'x dense':>9}{'a2a calls':>10}"
          f"{'a2a msg B/step':>16}{'a2a wire B/step':>17}{'allreduce wire B':>18}{'held-out':>10}{'rank diff':>11}")
    for r in results:
        s = summarise(r, args)
        ratio = s["ms"] / base["ms"] if base else float("nan")
        print(f"{r['name']:<10}{r['params_total']:>11,}{r['params_rank']:>11,}{s['ms']:>9.1f}{ratio:>9.2f}"
              f"{s['a2a_calls']:>10.0f}{s['a2a_msg']:>16,.0f}{s['a2a_wire']:>17,.0f}{s['ar_wire']:>18,.0f}"
              f"{r['held_out']:>10.4f}{r['rank_diff']:>11.1e}")
    print()
    print("a2a msg: the input bytes of every all_to_all_single per rank per step (dispatch + combine, forward and "
          "backward: 4 per MoE layer); wire: x (n-1)/n (all-reduce: x 2(n-1)/n of its group, so the expert "
          "gradients summed in 1-rank expert-data-parallel groups send nothing). rank diff: largest difference "
          "of a dense parameter between the ranks after training (0: the replicas agree).")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the step time")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--aux-coeff", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=list(RUNS),
                        help=f"comma-separated runs of {', '.join(RUNS)} (dense is the baseline)")
    args = parser.parse_args(argv)
    unknown = [x for x in args.only if x not in RUNS]
    if unknown:
        parser.error(f"--only: unknown run(s) {', '.join(unknown)}; valid: {', '.join(RUNS)}")
    if args.world % 2 and any(RUNS[x] and RUNS[x]["ep_size"] == 2 for x in args.only):
        parser.error("--world must be even for the ep_size-2 runs")
    if args.experts % 2:
        parser.error("--experts must be even (ep_size 2 shards them over 2 ranks)")
    print(f"MoE benchmark: {len(args.only)} runs of {args.steps} steps on {args.world} processes", flush=True)
    results = spawn_run(bench, args.world, args, threads=args.threads)
    report(results, args)


if __name__ == "__main__":
    main()
