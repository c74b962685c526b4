"""1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) vs their baselines on the `dsplug train` char LM.

    python benchmarks/onebit.py                     # 2 processes over gloo, 300 steps, 8 runs (~11 min on 2 cores)
    python benchmarks/onebit.py --steps 100 --layers 2 --freeze-step 30
    python benchmarks/onebit.py --only AdamW,OneBitAdam --freeze-fractions 0.25

One invocation trains the built-in character transformer (plugins/train: CharTransformer, the
built-in corpus, its train / held-out split, ``held_out_loss``) on ``--world`` processes (gloo,
127.0.0.1, ``--threads`` torch threads each), ZeRO stage 0, fp32, every run from the same seed
with the same data order (the engine's distributed loader, seeded by the config) and the same
number of steps, through ``dsplug.initialize`` and ``engine(x)`` / ``engine.backward`` /
``engine.step``. The config is the built-in ``dsplug train`` config (WarmupCosineLR with a linear
lr warm-up over 10 % of the steps, ``gradient_clipping`` 1.0, monitors off) with the optimizer
replaced:

* ``AdamW``       -- the baseline of the two Adam variants (the built-in lr / betas / eps / wd);
* ``OneBitAdam``  -- the same params + ``freeze_step`` F;
* ``ZeroOneAdam`` -- the same params + ``var_freeze_step`` F, ``var_update_scaler``,
  ``local_step_scaler``, ``local_step_clipper``, scaled to the run as DeepSpeed's BERT recipe
  scales them to its ~118k steps: ``local_step_scaler`` 28 % of the steps (32678), the clipper
  16, ``var_update_scaler`` 16 (so the local interval is 1, then 2, then 4 ... by the end);
* ``Lamb``        -- the baseline of 1-bit LAMB (``--lamb-lr``, the same betas / eps / wd);
* ``OneBitLamb``  -- Lamb's params + ``freeze_step`` F.

OneBitAdam and OneBitLamb run once per F of ``--freeze-fractions`` (default 25 % and 50 % of the
steps: DeepSpeed recommends a longer warm-up when the compressed stage loses accuracy);
ZeroOneAdam once per F of ``--zo-freeze-fractions`` (default 20 %, the BERT recipe's share, and
50 %, the warm-up 1-bit Adam needs on this short run).

Every collective of every rank is counted through the ``dsplug_comm_op`` hook (on ``dsplug.comm.events``): the message
size the comms logger reports (all_reduce: the tensor; all_gather: the whole output;
all_to_all_single: the whole input) and the bytes on the wire, message x
``comms_logger.logger.bus_factor(op, world)``. Per run the figures are per rank, per optimizer
step, averaged over the steps after F (after the warm-up of OneBitAdam / OneBitLamb, the variance
phase of ZeroOneAdam; the baseline over the same steps) and over the whole run; the held-out loss
of rank 0's final model; the mean (and median) step time (forward + backward + step, slowest rank)
over the steps after F. Ratios are to the named baseline of the same invocation.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from dsplug import hookimpl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _builtin_lm import builtin_lm_config  # noqa: E402
from _spawn import run as spawn_run  # noqa: E402

#: optimizer type -> its baseline (None: a baseline)
BASELINE = {"AdamW": None, "OneBitAdam": "AdamW", "ZeroOneAdam": "AdamW", "Lamb": None, "OneBitLamb": "Lamb"}
ORDER = ["AdamW", "OneBitAdam", "ZeroOneAdam", "Lamb", "OneBitLamb"]


def freeze_steps(args, kind: Optional[str] = None) -> List[int]:
    """The F values of ``kind`` (None: of every 1-bit optimizer): ``--freeze-step`` or each of
    ``--freeze-fractions`` (``--zo-freeze-fractions`` for ZeroOneAdam) of ``--steps``."""
    if args.freeze_step is not None:
        return [args.freeze_step]
    if kind is None:
        return sorted(set(freeze_steps(args, "OneBitAdam")) | set(freeze_steps(args, "ZeroOneAdam")))
    fractions = args.zo_freeze_fractions if kind == "ZeroOneAdam" else args.freeze_fractions
    return sorted({int(round(x * args.steps)) for x in fractions})


def local_step_scaler(args) -> int:
    """``--local-step-scaler``, or ``--local-step-scaler-fraction`` of ``--steps``."""
    if args.local_step_scaler is not None:
        return args.local_step_scaler
    return max(1, int(round(args.local_step_scaler_fraction * args.steps)))


def plan(args) -> List[tuple]:
    """(row name, optimizer type, F) of every run, in order; baselines run once (F: None)."""
    runs = []
    for kind in ORDER:
        if args.only and kind not in args.only:
            continue
        if BASELINE[kind] is None:
            runs.append((kind, kind, None))
        else:
            fs = freeze_steps(args, kind)
            runs.extend((kind if len(fs) == 1 else f"{kind} F={f}", kind, f) for f in fs)
    return runs


# ------------------------------------------------------------------------------ configs
def base_config(args) -> Dict[str, Any]:
    """The built-in ``dsplug train`` config without its monitors, filled in for this run."""
    raw = builtin_lm_config(args.micro_batch, args.seed, args.steps)
    raw["zero_optimization"] = {"stage": 0}
    return raw


def optimizer_section(kind: str, f: Optional[int], args, adam_params: Dict[str, Any]) -> Dict[str, Any]:
    params = dict(adam_params)
    if kind in ("Lamb", "OneBitLamb"):
        params["lr"] = args.lamb_lr
    if kind in ("OneBitAdam", "OneBitLamb"):
        params["freeze_step"] = f
    if kind == "ZeroOneAdam":
        params.update(var_freeze_step=f, var_update_scaler=args.var_update_scaler,
                      local_step_scaler=local_step_scaler(args), local_step_clipper=args.local_step_clipper)
    return {"type": kind, "params": params}


# ------------------------------------------------------------------------------ counting
class ByteCounter:
    """A ``dsplug_comm_op`` hook: message bytes and on-wire bytes (message x bus factor) of every collective."""

    def __init__(self):
        from dsplug.plugins.comms_logger.logger import bus_factor

        self.bus_factor = bus_factor
        self.message = 0
        self.wire = 0.0
        self.ops: collections.Counter = collections.Counter()

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, world_size):
        self.message += int(nbytes)
        self.wire += nbytes * self.bus_factor(op, world_size)
        self.ops[op] += 1

    def snapshot(self):
        return self.message, self.wire, collections.Counter(self.ops)


# ------------------------------------------------------------------------------ one rank
def _train_one(kind: str, config: Dict[str, Any], data, args) -> Dict[str, Any]:
    import dsplug
    from dsplug import comm
    from dsplug.plugins.train.data import batches_from, held_out_loss
    from dsplug.plugins.train.model import CharTransformer, ModelConfig, next_token_loss

    torch.manual_seed(args.seed)
    model = CharTransformer(ModelConfig(vocab_size=len(data["vocab"]), seq_len=args.seq_len, d_model=args.d_model,
                                        n_layers=args.layers, n_heads=args.heads))
    engine, _, loader, _ = dsplug.initialize(model=model, training_data=data["dataset"], config=config)
    batches = batches_from(loader, 0)
    counter = ByteCounter()
    comm.events.register(counter)
    per_step = []  # (message bytes, wire bytes, seconds, ops)
    losses = []
    try:
        engine.train()
        while engine.global_steps < args.steps:
            x, y = next(batches)
            before = counter.snapshot()
            start = time.perf_counter()
            loss = next_token_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            seconds = time.perf_counter() - start
            after = counter.snapshot()
            per_step.append((after[0] - before[0], after[1] - before[1], seconds, after[2] - before[2]))
            losses.append(float(loss.detach()))
    finally:
        comm.events.unregister(counter)
    # outside the counted steps: the ranks' parameters compared, and the slowest rank's step times
    flat = torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()])
    spread = flat.clone()
    comm.all_reduce(spread, op=comm.ReduceOp.MAX)
    low = flat.clone()
    comm.all_reduce(low, op=comm.ReduceOp.MIN)
    rank_diff = float((spread - low).abs().max())
    times = torch.tensor([s[2] for s in per_step], dtype=torch.float64)
    comm.all_reduce(times, op=comm.ReduceOp.MAX)
    bytes_here = torch.tensor([[s[0], s[1]] for s in per_step], dtype=torch.float64)
    bytes_max = bytes_here.clone()
    comm.all_reduce(bytes_max, op=comm.ReduceOp.MAX)
    same = torch.tensor([float(torch.equal(bytes_here, bytes_max))])
    comm.all_reduce(same, op=comm.ReduceOp.MIN)
    same_bytes = bool(same.item() == 1.0)
    loss = held_out_loss(engine.module, data["held_tokens"], args.seq_len, args.micro_batch)
    engine.destroy()
    return {"kind": kind, "per_step": [(m, w, float(t), dict(o)) for (m, w, _, o), t in zip(per_step, times)],
            "held_out": loss, "train_loss": statistics.fmean(losses[-20:]), "rank_diff": rank_diff,
            "same_bytes_all_ranks": same_bytes}


def bench(args) -> Dict[str, Any]:
    import dsplug
    from dsplug.plugins.train.data import CharVocab, CharWindows, read_builtin_corpus, split_tokens

    dsplug.init_distributed(verbose=False)
    text = read_builtin_corpus()
    vocab = CharVocab.of_text(text)
    tokens = torch.tensor(vocab.encode(text), dtype=torch.long)
    train_tokens, held_tokens = split_tokens(tokens, args.seq_len)
    data = {"vocab": vocab, "dataset": CharWindows(train_tokens, args.seq_len), "held_tokens": held_tokens}
    config = base_config(args)
    adam_params = config["optimizer"]["params"]
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for name, kind, f in plan(args):
        cfg = dict(config, optimizer=optimizer_section(kind, f, args, adam_params))
        result = _train_one(kind, cfg, data, args)
        result["name"], result["params"], result["freeze"] = name, cfg["optimizer"]["params"], f
        results.append(result)
        if rank == 0:
            print(f"  {name}: done, held-out loss {result['held_out']:.4f}", flush=True)
    n_params = sum(p.numel() for p in _model_params(args, len(vocab)))
    return {"results": results, "params": n_params, "chars": len(text), "windows": len(data["dataset"]),
            "held": len(held_tokens), "vocab": len(vocab), "config": config}


def _model_params(args, vocab_size: int):
    from dsplug.plugins.train.model import CharTransformer, ModelConfig

    return list(CharTransformer(ModelConfig(vocab_size=vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                                            n_layers=args.layers, n_heads=args.heads)).parameters())


# ------------------------------------------------------------------------------ report
def _local_intervals(f: int, args) -> str:
    """0/1 Adam's local-step interval over the steps after ``f`` (as the optimizer schedules it)."""
    scaler, parts, interval, start = local_step_scaler(args), [], 1, f + 1
    while start <= args.steps:
        end = min(args.steps, start + scaler - 1)
        parts.append(f"{interval} (steps {start}-{end})")
        if interval == args.local_step_clipper:
            parts[-1] = f"{interval} (steps {start}-{args.steps})"
            break
        interval, start = min(2 * interval, args.local_step_clipper), end + 1
    return ", ".join(parts) or "none (no step after F)"


def _mean(values: List[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarise(result: Dict[str, Any], f: int, args) -> Dict[str, Any]:
    """Bytes over the steps after ``f`` and over the whole run, step times after ``max(f, warmup)``."""
    steps = result["per_step"]
    after = steps[f:]
    timed = [s[2] for s in steps[max(f, args.warmup):]]
    ops: collections.Counter = collections.Counter()
    for s in after:
        ops.update(s[3])
    return {"msg_after": _mean([s[0] for s in after]), "wire_after": _mean([s[1] for s in after]),
            "msg_all": _mean([s[0] for s in steps]), "wire_all": _mean([s[1] for s in steps]),
            "ms": _mean(timed) * 1e3, "median_ms": statistics.median(timed) * 1e3 if timed else float("nan"),
            "ops": {op: n / max(1, len(after)) for op, n in sorted(ops.items())}}


def report(out: Dict[str, Any], args) -> None:
    results = {r["name"]: r for r in out["results"]}
    config = out["config"]
    adam = config["optimizer"]["params"]
    print()
    print(f"character transformer: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context "
          f"{args.seq_len}, vocabulary {out['vocab']}, {out['params']:,} parameters (fp32 gradient "
          f"{4 * out['params']:,} B); {out['chars'] / 1000:.0f} KB built-in corpus ({out['windows']} training "
          f"windows, {out['held']} held-out characters)")
    print(f"{args.world} processes (gloo), {args.threads} thread(s) each, ZeRO stage 0, fp32; {args.steps} steps x "
          f"{args.micro_batch} sequences per rank; seed {args.seed}; WarmupCosineLR (linear lr warm-up "
          f"{config['scheduler']['params']['warmup_num_steps']} steps, cosine to 0.1 x lr), gradient_clipping "
          f"{config['gradient_clipping']}")
    print(f"Adam-type params: lr {adam['lr']}, betas {adam['betas']}, eps {adam['eps']}, weight_decay "
          f"{adam['weight_decay']}; Lamb-type: lr {args.lamb_lr}, same betas / eps / weight_decay")
    print(f"F: OneBitAdam / OneBitLamb freeze_step, ZeroOneAdam var_freeze_step (var_update_scaler "
          f"{args.var_update_scaler}, local_step_scaler {local_step_scaler(args)}, local_step_clipper "
          f"{args.local_step_clipper}). Baselines: AdamW for OneBitAdam / ZeroOneAdam, Lamb for OneBitLamb.")
    for f in freeze_steps(args, "ZeroOneAdam"):
        print(f"ZeroOneAdam F={f}: steps between synchronisations {_local_intervals(f, args)}")
    print()
    print(f"{'optimizer':<20}{'vs':<7}{'F':>4}{'msg B/step':>12}{'x fewer':>9}{'wire B/step':>13}{'x fewer':>9}"
          f"{'run msg B/st':>14}{'x fewer':>9}{'held-out':>10}{'rel diff':>10}{'ms/step':>9}{'x':>6}"
          f"{'median':>8}{'x':>6}")
    for name, r in results.items():
        base_name = BASELINE[r["kind"]]
        base = results.get(base_name) if base_name else None
        f = r["freeze"] if r["freeze"] is not None else min(freeze_steps(args))
        mine = summarise(r, f, args)
        theirs = summarise(base, f, args) if base is not None else mine
        b = base if base is not None else r

        def fewer(key):
            return theirs[key] / mine[key] if mine[key] else float("inf")

        print(f"{name:<20}{base_name or '-':<7}{r['freeze'] if r['freeze'] is not None else '-':>4}"
              f"{mine['msg_after']:>12,.0f}{fewer('msg_after'):>9.3f}{mine['wire_after']:>13,.0f}"
              f"{fewer('wire_after'):>9.3f}{mine['msg_all']:>14,.0f}{fewer('msg_all'):>9.3f}"
              f"{r['held_out']:>10.4f}{(r['held_out'] - b['held_out']) / b['held_out'] * 100:>+9.2f}%"
              f"{mine['ms']:>9.1f}{mine['ms'] / theirs['ms']:>6.2f}{mine['median_ms']:>8.1f}"
              f"{mine['median_ms'] / theirs['median_ms']:>6.2f}")
    print()
    print("msg / wire B/step: per rank per optimizer step, mean over the steps after F (baselines: after the "
          f"smallest F, {min(freeze_steps(args))}); msg = the comms logger's message sizes, wire = msg x "
          f"bus_factor(op, {args.world}); run msg B/st: mean over all {args.steps} steps (warm-up included). "
          "x fewer: baseline / this, over the same steps. held-out: rank 0's final model; rel diff: to the "
          "baseline. ms/step, median: forward+backward+step of the slowest rank, mean / median over the steps "
          f"after max(F, {args.warmup}); x: this / baseline over the same steps.")
    print()
    for name, r in results.items():
        f = r["freeze"] if r["freeze"] is not None else min(freeze_steps(args))
        ops = ", ".join(f"{op} {n:.2f}" for op, n in summarise(r, f, args)["ops"].items()) or "none"
        print(f"{name:<20} collectives/step after F: {ops}; train loss (mean of last 20 steps) "
              f"{r['train_loss']:.4f}; max |param difference| between ranks at the end {r['rank_diff']:.1e}; "
              f"same bytes on every rank: {r['same_bytes_all_ranks']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--freeze-fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5],
                        help="F values (freeze_step / var_freeze_step) as fractions of --steps; each 1-bit optimizer "
                             "runs once per F")
    parser.add_argument("--freeze-step", type=int, default=None, help="one F in steps (overrides the fractions)")
    parser.add_argument("--zo-freeze-fractions", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.2, 0.5], help="ZeroOneAdam's var_freeze_step values as fractions of --steps")
    parser.add_argument("--var-update-scaler", type=int, default=16, help="ZeroOneAdam (DeepSpeed default 16)")
    parser.add_argument("--local-step-scaler", type=int, default=None,
                        help="ZeroOneAdam: steps after which the local-step interval doubles (default: "
                             "--local-step-scaler-fraction of --steps)")
    parser.add_argument("--local-step-scaler-fraction", type=float, default=0.28,
                        help="ZeroOneAdam: local_step_scaler as a fraction of --steps (DeepSpeed's BERT recipe: "
                             "32678 of ~118k steps)")
    parser.add_argument("--local-step-clipper", type=int, default=16,
                        help="ZeroOneAdam: largest local-step interval (DeepSpeed default 16)")
    parser.add_argument("--lamb-lr", type=float, default=0.04, help="lr of Lamb and OneBitLamb")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time means")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None,
                        help="comma-separated subset of " + ",".join(ORDER))
    args = parser.parse_args(argv)
    if args.only and set(args.only) - set(ORDER):
        parser.error(f"--only: unknown {sorted(set(args.only) - set(ORDER))}; choose from {', '.join(ORDER)}")
    for f in freeze_steps(args):
        if not 0 <= f < args.steps:
            parser.error(f"F = {f} must be in [0, --steps)")
    if args.world < 2:
        parser.error("--world must be at least 2 (nothing is compressed in a world of one)")
    print(f"training {', '.join(n for n, _, _ in plan(args))} on {args.world} processes ...", flush=True)
    start = time.perf_counter()
    out = spawn_run(bench, args.world, args, threads=args.threads)
    report(out, args)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
