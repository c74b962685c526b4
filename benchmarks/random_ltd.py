"""Random-LTD on the `dsplug train` character LM: step time and held-out loss vs no random-LTD.

    python benchmarks/random_ltd.py                         # 120 steps, 6 layers, context 256 (~4 min on 2 cores)
    python benchmarks/random_ltd.py --steps 40 --layers 4 --seq-len 128

One invocation trains the built-in character transformer (plugins/train: CharTransformer, the
built-in corpus, its train / held-out split, ``held_out_loss``) three times with the same seed,
initial weights and data order (the engine's loader, seeded by the config), each through
``dsplug.initialize`` (AdamW + WarmupCosineLR as in the built-in ``default_config.json``,
monitors off) and ``engine(x)`` / ``engine.backward`` / ``engine.step``. The three engines take
turns step by step, so a change of machine load hits them alike:

* ``no random-LTD``: the baseline;
* ``random-LTD 50%``: ``data_efficiency.data_routing.random_ltd`` on every block but the first and
  the last (DeepSpeed's practice), each keeping half the tokens for the whole run
  (``min_value = max_value = seq_len / 2``);
* ``random-LTD 50%->100%``: the same layers, kept tokens ``fixed_linear`` from half to the whole
  context over the run (``require_steps`` = steps, ``seq_per_step`` 16).

Blocks are wrapped with ``convert_to_random_ltd(model, Block)`` before ``initialize``. Per
variant: mean training step time (forward + backward + step, ms, after ``--warmup`` steps), the
tokens the blocks ran on (summed over blocks and steps, from each wrapper's ``reserved_length``), held-out loss
(evaluation runs every token), each with its ratio to ``no random-LTD``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _builtin_lm import builtin_lm_config  # noqa: E402

BASELINE = "no random-LTD"


def base_config(args) -> Dict[str, Any]:
    """The built-in ``dsplug train`` config without its monitors, filled in for this run."""
    raw = builtin_lm_config(args.micro_batch, args.seed, args.steps)
    return raw


def ltd_section(args, min_value: int, max_value: int) -> Dict[str, Any]:
    ids = list(range(1, args.layers - 1))
    return {"enabled": True, "seed": args.seed, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": args.layers, "random_ltd_layer_num": len(ids), "random_ltd_layer_id": ids,
        "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": min_value, "max_value": max_value, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": args.steps, "seq_per_step": 16}}}}}


class Run:
    def __init__(self, name: str, section: Optional[Dict[str, Any]], args, data):
        import dsplug
        from dsplug.plugins.train.data import batches_from
        from dsplug.plugins.train.model import Block, CharTransformer, ModelConfig
        from dsplug.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

        self.name, self.args = name, args
        torch.manual_seed(args.seed)
        model = CharTransformer(ModelConfig(vocab_size=len(data.vocab), seq_len=args.seq_len, d_model=args.d_model,
                                            n_layers=args.layers, n_heads=args.heads))
        if section is not None:
            convert_to_random_ltd(model, Block)
        config = base_config(args)
        if section is not None:
            config["data_efficiency"] = section
        self.engine, _, loader, _ = dsplug.initialize(model=model, training_data=data.dataset, config=config)
        self.batches = batches_from(loader, 0)
        self.times: List[float] = []
        self.tokens = 0
        self.engine.train()

    def step(self) -> None:
        from dsplug.plugins.train.model import next_token_loss

        x, y = next(self.batches)
        start = time.perf_counter()
        loss = next_token_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        self.times.append(time.perf_counter() - start)
        kept = [getattr(b, "reserved_length", None) or x.shape[1] for b in self.engine.module.blocks]
        self.tokens += x.shape[0] * sum(kept)  # what each block ran on in this step


class Data:
    def __init__(self, args):
        from dsplug.plugins.train.data import CharVocab, CharWindows, read_builtin_corpus, split_tokens

        text = read_builtin_corpus()
        self.vocab = CharVocab.of_text(text)
        tokens = torch.tensor(self.vocab.encode(text), dtype=torch.long)
        self.train_tokens, self.held_tokens = split_tokens(tokens, args.seq_len)
        self.dataset = CharWindows(self.train_tokens, args.seq_len)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (timings are steadier with 1)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time means")
    args = parser.parse_args(argv)
    if args.layers < 3:
        parser.error("--layers must be at least 3 (random-LTD skips the first and the last block)")
    torch.set_num_threads(args.threads)
    from dsplug.plugins.train.data import held_out_loss

    data = Data(args)
    half = args.seq_len // 2
    runs = [Run(BASELINE, None, args, data),
            Run("random-LTD 50%", ltd_section(args, half, half), args, data),
            Run("random-LTD 50%->100%", ltd_section(args, half, args.seq_len), args, data)]
    print(f"character transformer: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context "
          f"{args.seq_len}; {args.steps} steps x {args.micro_batch} sequences; torch {torch.__version__}, "
          f"{args.threads} thread(s); random-LTD on blocks 1..{args.layers - 2}", flush=True)
    for step in range(args.steps):
        for run in runs:
            run.step()
        if (step + 1) % max(1, args.steps // 4) == 0:
            print(f"  step {step + 1}/{args.steps}", flush=True)
    rows = []
    for run in runs:
        model = run.engine.module
        model.eval()
        loss = held_out_loss(model, data.held_tokens, args.seq_len, args.micro_batch)
        ms = statistics.fmean(run.times[args.warmup:]) * 1e3
        rows.append({"name": run.name, "ms": ms, "tokens": run.tokens, "loss": loss})
        run.engine.destroy()
    base = rows[0]
    print()
    print(f"{'variant':<22}{'step ms':>9}{'x':>7}{'layer tokens':>15}{'x':>7}{'held-out':>10}{'x':>7}")
    for r in rows:
        print(f"{r['name']:<22}{r['ms']:>9.1f}{r['ms'] / base['ms']:>7.3f}{r['tokens']:>15,}"
              f"{r['tokens'] / base['tokens']:>7.3f}{r['loss']:>10.4f}{r['loss'] / base['loss']:>7.3f}")
    print(f"x: ratio to {BASELINE!r} (same invocation, engines stepping in turn). step ms: mean training step "
          f"(forward+backward+step) after {args.warmup} warm-up steps. layer tokens: tokens processed by all "
          f"blocks over the run. held-out: next-character loss, every token evaluated.")


if __name__ == "__main__":
    sys.exit(main())
