"""DeepSpeed 0.19.8 training a tiny GPT-2 in bf16 under the Hugging Face Trainer at ZeRO-2 and
ZeRO-3, for tests/plugins/deepspeed_alias/test_huggingface.py.

DeepSpeed is a black box here, never a dependency. It runs in a separate virtual environment that
has DeepSpeed but not transformers / accelerate; ``--site`` appends a site-packages folder that has
them (same torch) to ``sys.path``::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \\
        tests/data/deepspeed/make_hf_bf16_trainer.py --site /work/venv-deps/lib/python3.11/site-packages

runs each stage in a child process and records in ``hf_bf16_trainer.json``, under this CPU's
description (:func:`cpu_description`; bf16 results depend on the CPU's bf16 kernels, so each kind
of CPU the test runs on needs its own recording, added beside the others): per stage, the Trainer's
logged loss and grad_norm of each of the ``STEPS`` steps and, per parameter, the sum and the sum of
absolute values (float64) of the trained weights. Gradient clipping is on (the Trainer's 1.0) and
active at every step, gradients are accumulated over 2 micro-steps in bf16 (DeepSpeed's default
``grad_accum_dtype`` under ZeRO): the norm's precision, the clip coefficient's arithmetic and the
accumulation dtype all show in the losses after a few steps. The test runs this same file with
dsplug's ``deepspeed`` alias on the path and ``--stage N --print``, and compares.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "hf_bf16_trainer.json")
STEPS = 20
STAGES = (2, 3)


def train(stage: int, out_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, seq=16, vocab=64, seed=0):
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, vocab, (n, seq), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}

    ds_config = {
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 2000,
    }
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config, use_cpu=True, bf16=True, seed=0, report_to="none",
        disable_tqdm=True, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
        weight_decay=0.01, warmup_steps=2, max_steps=STEPS, logging_steps=1, save_strategy="no", eval_strategy="no",
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                        n_positions=32, bos_token_id=0, eos_token_id=0))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(8 * STEPS))
    trainer.train()

    import deepspeed

    params = dict(trainer.model_wrapped.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        weights = {name: [float(p.detach().double().sum()), float(p.detach().double().abs().sum())]
                   for name, p in params.items()}
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"bf16": trainer.accelerator.deepspeed_config["bf16"]["enabled"] is True,
            "zero_stage": trainer.accelerator.deepspeed_config["zero_optimization"]["stage"],
            "losses": [h["loss"] for h in logged], "grad_norms": [h["grad_norm"] for h in logged],
            "weights": weights}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_description() -> str:
    """The CPU's model name and the instruction sets that decide bf16 arithmetic (the recorded
    trajectories of one description are reproduced bit for bit by another machine with it)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = [name for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if name in flags]
    return f"{model} [{' '.join(isa) or 'no avx2'}]"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", help="a site-packages folder with transformers and accelerate (appended)")
    parser.add_argument("--stage", type=int, help="run this stage and print 'RESULT <json>'")
    parser.add_argument("--print", action="store_true")
    a = parser.parse_args()
    if a.stage is None:  # the fixture: each stage in a fresh process
        result = {}
        for stage in STAGES:
            cmd = [sys.executable, __file__, "--stage", str(stage), "--print"] + (["--site", a.site] if a.site else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result[str(stage)] = json.loads(out.split("RESULT ", 1)[1])
        import_version = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                                        capture_output=True, text=True, check=True).stdout.strip()
        fixture = {"deepspeed": import_version, "steps": STEPS, "machines": []}
        if os.path.exists(FIXTURE):
            with open(FIXTURE) as f:
                fixture = json.load(f)
            if fixture["deepspeed"] != import_version or fixture["steps"] != STEPS:
                raise SystemExit(f"{FIXTURE} holds DeepSpeed {fixture['deepspeed']} / {fixture['steps']} steps; "
                                 f"this run is {import_version} / {STEPS}: move the old file away first")
        cpu = cpu_description()
        fixture["machines"] = [m for m in fixture["machines"] if m["cpu"] != cpu] + [{"cpu": cpu, "stages": result}]
        with open(FIXTURE, "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")
        return
    if a.site:
        sys.path.append(a.site)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(key, value)  # one process, no launcher (DeepSpeed would look for MPI)
    import deepspeed

    with tempfile.TemporaryDirectory() as out_dir:
        result = {"deepspeed": deepspeed.__version__, **train(a.stage, out_dir)}
    print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main()
