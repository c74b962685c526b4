"""Autotuning the built-in character LM over 2 processes, then checking what it found.

1. ``dsplug launch --num_procs 2 --autotuning tune`` over ZeRO stages 0 and 2 and the micro-batch
   range 1..64 (3 sizes) -- real experiments, measured between the profile steps;
2. the two best configs and a baseline (the built-in ``dsplug train`` default: micro-batch 32,
   ZeRO stage 0) are re-run for longer with plain ``dsplug launch``, interleaved, ``--repeats``
   times each; the script times its own steady-state steps and the best repeat counts (on a
   shared machine the fastest repeat is the one least disturbed by other work);
3. prints the tuning's ranking, the re-measured throughput as ratios to the baseline, and whether
   the tuner's order of the top two held.

    python benchmarks/autotuning.py [--steps 40] [--repeats 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import argparse, json, time
    import torch
    import dsplug as deepspeed
    from dsplug.plugins.train.model import CharTransformer, ModelConfig, next_token_loss

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timed_from", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = CharTransformer(ModelConfig(vocab_size=96, seq_len=64, d_model=128, n_layers=2, n_heads=4))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    g = torch.Generator().manual_seed(deepspeed.comm.get_rank())
    start = None
    for step in range(args.steps):
        if step == args.timed_from:
            start = time.perf_counter()
        for _ in range(gas):
            tokens = torch.randint(0, 96, (mbs, 65), generator=g)
            loss = next_token_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
    elapsed = time.perf_counter() - start
    if args.out and deepspeed.comm.get_rank() == 0:
        timed = args.steps - args.timed_from
        with open(args.out, "w") as f:
            json.dump({"samples_per_s": timed * engine.train_batch_size() / elapsed,
                       "ms_per_step": 1000 * elapsed / timed}, f)
    """
)


def launch(cwd, args, *, timeout=1800):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "dsplug.cli", "launch", "--num_procs", "2", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rerun(cwd, config, steps, name):
    path = os.path.join(cwd, f"rerun_{name}.json")
    with open(os.path.join(cwd, f"rerun_{name}_config.json"), "w") as f:
        json.dump(config, f)
    done = launch(cwd, ["lm.py", "--deepspeed_config", f"rerun_{name}_config.json", "--steps", str(steps),
                        "--out", path])
    if done.returncode != 0:
        raise SystemExit(f"re-run {name} failed:\n{done.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps of each re-run (the first 5 are not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="re-runs of each config (interleaved); the best counts")
    parser.add_argument("--keep", default=None, help="work in this directory and keep it")
    opts = parser.parse_args()
    work = opts.keep or tempfile.mkdtemp(prefix="dsplug-autotuning-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        with open(os.path.join(work, "lm.py"), "w") as f:
            f.write(SCRIPT)
        base = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "steps_per_print": 10 ** 9}
        tuning = {**base, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": [0, 2]},
                  "autotuning": {"max_train_micro_batch_size_per_gpu": 64, "num_tuning_micro_batch_sizes": 3,
                                 "start_profile_step": 3, "end_profile_step": 12, "tuner_type": "gridsearch"}}
        with open(os.path.join(work, "ds.json"), "w") as f:
            json.dump(tuning, f)
        t0 = time.monotonic()
        done = launch(work, ["--autotuning", "tune", "lm.py", "--deepspeed_config", "ds.json", "--steps", "100"])
        tuning_s = time.monotonic() - t0
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-4000:])
            return 1
        print(done.stdout)
        results = os.path.join(work, "autotuning_results")
        with open(os.path.join(results, "summary.json")) as f:
            summary = json.load(f)
        ranking = summary["ranking"]
        print(f"tuning: {summary['experiments_run']} experiments in {tuning_s:.0f} s")
        baseline = {**base, "train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 0}}
        configs = {"baseline (z0, micro-batch 32)": baseline}
        for entry in ranking[:2]:
            with open(os.path.join(work, "autotuning_exps", entry["name"], "ds_config.json")) as f:
                config = json.load(f)
            config.pop("autotuning")
            configs[f"#{entry['rank']} {entry['name']}"] = config
        measured = {}
        for repeat in range(opts.repeats):
            for i, (name, config) in enumerate(configs.items()):
                m = rerun(work, config, opts.steps, f"{i}_{repeat}")
                if name not in measured or m["samples_per_s"] > measured[name]["samples_per_s"]:
                    measured[name] = m
        ref = measured["baseline (z0, micro-batch 32)"]["samples_per_s"]
        print(f"\nre-run, {opts.steps} steps each (first 5 untimed), best of {opts.repeats}, 2 processes, samples/s "
              f"(ratio to the baseline):")
        for name, m in measured.items():
            print(f"  {name:<32} {m['samples_per_s']:10.1f}  {m['samples_per_s'] / ref:5.2f}x   "
                  f"{m['ms_per_step']:.1f} ms/step")
        if len(ranking) >= 2:
            first, second = (measured[f"#{e['rank']} {e['name']}"]["samples_per_s"] for e in ranking[:2])
            print(f"tuner's order of the top two held on re-run: {'yes' if first >= second else 'no'} "
                  f"({first:.1f} vs {second:.1f} samples/s)")
        return 0
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
