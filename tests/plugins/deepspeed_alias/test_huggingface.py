"""Hugging Face Trainer and Accelerate running unchanged on dsplug (``dsplug deepspeed-alias``).

transformers and accelerate are used exactly as their DeepSpeed documentation shows: the Trainer
gets ``TrainingArguments(deepspeed={...})`` with the guide's ZeRO-2 / ZeRO-3 ``"auto"`` templates;
an Accelerate loop gets ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``. The
only dsplug-specific step is the alias: ``dsplug deepspeed-alias enable --target DIR`` writes the
``deepspeed`` package and distribution metadata into a throwaway directory that is put on the
children's ``PYTHONPATH`` -- this interpreter never sees a ``deepspeed``.

Every run is a subprocess (1 process, or 2 started by the alias's ``deepspeed`` command or by
torchrun) with the hub offline: the model is a tiny ``GPT2Config`` built from scratch and the data
random token ids, so nothing is downloaded.

CPU note (see docs/huggingface.md): accelerate only counts the processes of a CPU-only world when
its ``PartialState`` is made with ``cpu=True`` -- ``TrainingArguments(use_cpu=True)`` for the
Trainer, ``PartialState(cpu=True)`` before ``Accelerator(...)`` in a loop. Without it accelerate
sees one process; with ``ACCELERATE_USE_CPU=1`` or ``Accelerator(cpu=True)`` it drops DeepSpeed.
``test_cpu_world_size_setting`` pins both halves of that down.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.conftest import scaled

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None,
                       reason="a deepspeed is importable in the test interpreter; these tests serve it from dsplug"),
]

TIMEOUT = 300

COMMON = '''
import json, os, sys
import torch


class Tokens(torch.utils.data.Dataset):
    """Random token ids; labels are the ids (the model shifts them)."""

    def __init__(self, n, seq=16, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def tiny_config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)


def gathered(module):
    """A full copy of every parameter (ZeRO-3 partitions gathered; a no-op context under ZeRO-2)."""
    import deepspeed
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {k: v.detach().clone().float() for k, v in params.items()}
'''

# The Hugging Face guide's "auto" templates (ds_config_zero2.json / ds_config_zero3.json), verbatim.
TRAINER_SCRIPT = COMMON + '''
import argparse
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--max_steps", type=int, required=True)
p.add_argument("--save_steps", type=int, required=True)
p.add_argument("--resume", default=None)
p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
a = p.parse_args()

zero2 = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
         "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
         "contiguous_gradients": True}
zero3 = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
         "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
         "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
         "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
         "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
ds_config = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                   "warmup_num_steps": "auto"}},
    "zero_optimization": zero2 if a.stage == 2 else zero3,
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

# use_cpu=True: accelerate's PartialState then sets up gloo and counts every process (see the docs)
args = TrainingArguments(
    output_dir=a.out, deepspeed=ds_config, use_cpu=True, seed=0, report_to="none", disable_tqdm=True,
    per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
    learning_rate=1e-3, weight_decay=0.01, warmup_steps=2, max_steps=a.max_steps, logging_steps=1,
    save_strategy="steps", save_steps=a.save_steps, eval_strategy="no",
)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(tiny_config())  # under ZeRO-3: built inside deepspeed.zero.Init


class Losses(TrainerCallback):
    """The losses logged by *this* process (the log history of a resumed run also holds the old ones)."""
    seen = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.seen.append([state.global_step, logs["loss"]])


trainer = Trainer(model=model, args=args, train_dataset=Tokens(64), eval_dataset=Tokens(16, seed=1),
                  callbacks=[Losses()])
trainer.train(resume_from_checkpoint=a.resume)
metrics = trainer.evaluate()
final = os.path.join(a.out, "final")
trainer.save_model(final)
trainer.accelerator.wait_for_everyone()

live = gathered(trainer.model_wrapped.module)  # the engine's weights, compared by the test with what was saved
result = {
    "deepspeed": trainer.is_deepspeed_enabled, "engine": type(trainer.model_wrapped).__module__,
    "world": args.world_size, "zero_stage": trainer.accelerator.deepspeed_config["zero_optimization"]["stage"],
    "train_batch_size": trainer.accelerator.deepspeed_config["train_batch_size"],
    "history": [[h["step"], h["loss"]] for h in trainer.state.log_history if "loss" in h],
    "trained_here": Losses.seen, "eval_loss": metrics["eval_loss"], "global_step": trainer.state.global_step,
    "engine_steps": trainer.model_wrapped.global_steps,
    "checksum": sum(float(v.double().sum()) for v in live.values()),
}
if trainer.is_world_process_zero():
    torch.save(live, os.path.join(a.out, "engine_weights.pt"))
    print("RESULT", json.dumps(result))
'''

ACCELERATE_SCRIPT = COMMON + '''
import argparse
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from transformers import GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["straight", "resume"], required=True)
a = p.parse_args()
N = 3  # optimizer steps before the save_state, and after it
GAS = 2

ds_config = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
}
PartialState(cpu=True)  # CPU: gloo, and every process counted (see the docs); DeepSpeed stays on
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config, zero_stage=a.stage,
                                                           gradient_accumulation_steps=GAS))
torch.manual_seed(0)
model = GPT2LMHeadModel(tiny_config())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 100)
loader = torch.utils.data.DataLoader(Tokens(64), batch_size=2, shuffle=False)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)


def train(dataloader, micro_steps):
    # one row per micro-batch: loss (mean over processes), sync_gradients, engine optimizer steps, LR;
    # first the state before the first batch
    rows = [[None, True, model.global_steps, scheduler.get_last_lr()[0]]]
    for i, batch in enumerate(dataloader):
        if i == micro_steps:
            break
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        rows.append([accelerator.gather(loss.detach()).mean().item(), accelerator.sync_gradients,
                     model.global_steps, scheduler.get_last_lr()[0]])
    return rows


state_dir = os.path.join(a.out, "state")
first = []
if a.mode == "straight":
    first = train(loader, GAS * N)
    accelerator.save_state(state_dir)
else:
    accelerator.load_state(state_dir)
second = train(accelerator.skip_first_batches(loader, GAS * N), GAS * N)

sd = accelerator.get_state_dict(model)  # ZeRO-3: gathered (stage3_gather_16bit_weights_on_model_save)
live = gathered(model.module)
sd_mismatch = sorted(k for k in live if k not in sd or not torch.equal(live[k], sd[k].float())) \\
    if accelerator.is_main_process else []
result = {"type": str(accelerator.distributed_type), "world": accelerator.num_processes,
          "gas": accelerator.gradient_accumulation_steps,
          "train_batch_size": accelerator.deepspeed_config["train_batch_size"],
          "zero_stage": accelerator.deepspeed_config["zero_optimization"]["stage"],
          "first": first, "second": second, "state_dict_keys": sorted(sd) if accelerator.is_main_process else [],
          "sd_mismatch": sd_mismatch, "checksum": sum(float(v.double().sum()) for v in live.values())}
if accelerator.is_main_process:
    print("RESULT", json.dumps(result))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def alias(tmp_path_factory) -> Path:
    """``dsplug deepspeed-alias enable --target DIR``: a deepspeed package + metadata only the children see."""
    target = tmp_path_factory.mktemp("deepspeed-alias")
    proc = subprocess.run([sys.executable, "-m", "dsplug.cli", "deepspeed-alias", "enable", "--target", str(target)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def _env(alias: Path, **extra) -> dict:
    env = dict(os.environ)
    for name in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSPLUG_BLOCK_PLUGINS"):
        env.pop(name, None)
    env.update(PYTHONPATH=os.pathsep.join(p for p in [str(alias), env.get("PYTHONPATH", "")] if p),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _run(alias: Path, cwd: Path, script: str, args: list, procs: int, launcher: str = "deepspeed",
         **env) -> subprocess.CompletedProcess:
    path = cwd / "script.py"
    path.write_text(textwrap.dedent(script))
    if procs == 1:
        cmd = [sys.executable, str(path), *args]
    elif launcher == "deepspeed":  # the alias's `deepspeed` command, as the HF guide launches the Trainer
        cmd = [sys.executable, str(alias / "bin" / "deepspeed"), "--num_procs", str(procs), "--master_port",
               str(_free_port()), str(path), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), str(path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(cwd), env=_env(alias, **env), timeout=scaled(TIMEOUT))
    assert proc.returncode == 0, \
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


def _load_weights(path: Path) -> dict:
    import torch

    return torch.load(str(path), weights_only=True)


def _saved_model_weights(path: Path) -> dict:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(path))
    return {k: v.detach().float() for k, v in model.named_parameters()}


def _assert_same_weights(got: dict, want: dict) -> None:
    import torch

    assert sorted(got) == sorted(want) and len(want) > 0
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


# ------------------------------------------------------------------------------------------ Trainer

N = 3  # optimizer steps before the checkpoint the resumed run starts from, and after it


# (one process at each stage is the Accelerate test's below; left out here to keep the file's cost down)
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage, procs", [(2, 2), (3, 2)])
def test_trainer_deepspeed_dict_config(alias, tmp_path, stage, procs):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    args = ["--stage", str(stage), "--max_steps", str(2 * N), "--save_steps", str(N)]
    straight = _result(_run(alias, tmp_path, TRAINER_SCRIPT, [*args, "--out", str(straight_dir)], procs))

    assert straight["deepspeed"] and straight["engine"] == "dsplug.engine", straight
    assert straight["world"] == procs and straight["zero_stage"] == stage
    assert straight["train_batch_size"] == 2 * 2 * procs  # micro 2 x accumulation 2 x world
    assert straight["global_step"] == straight["engine_steps"] == 2 * N
    steps = [s for s, _ in straight["history"]]
    assert steps == list(range(1, 2 * N + 1))
    assert straight["trained_here"] == straight["history"]
    assert all(3.0 < loss < 5.0 for _, loss in straight["history"])  # ~ln(64) = 4.16 for random tokens
    assert 3.0 < straight["eval_loss"] < 5.0
    # save_model wrote loadable weights: a fresh GPT2LMHeadModel (here, no DeepSpeed) holds the engine's weights
    engine_weights = _load_weights(straight_dir / "engine_weights.pt")
    assert (straight_dir / "final" / "model.safetensors").is_file()
    _assert_same_weights(_saved_model_weights(straight_dir / "final"), engine_weights)
    # and the guide's offline recovery from the last checkpoint (checkpoint-*/zero_to_fp32.py's function)
    from dsplug.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    recovered = get_fp32_state_dict_from_zero_checkpoint(str(straight_dir / f"checkpoint-{2 * N}"))
    assert (straight_dir / f"checkpoint-{2 * N}" / "zero_to_fp32.py").is_file()
    _assert_same_weights({k: recovered[k].float() for k in engine_weights}, engine_weights)

    # resume_from_checkpoint: a fresh process continues from checkpoint-N and logs the same losses
    checkpoint = straight_dir / f"checkpoint-{N}"
    assert (checkpoint / "latest").is_file()
    resumed = _result(_run(alias, tmp_path, TRAINER_SCRIPT,
                           [*args, "--out", str(resumed_dir), "--resume", str(checkpoint)], procs))
    assert [s for s, _ in resumed["trained_here"]] == list(range(N + 1, 2 * N + 1))  # only the later steps ran
    assert resumed["trained_here"] == straight["history"][N:]  # bit-for-bit equal losses
    assert resumed["history"] == straight["history"]
    assert resumed["eval_loss"] == straight["eval_loss"] and resumed["checksum"] == straight["checksum"]
    _assert_same_weights(_load_weights(resumed_dir / "engine_weights.pt"), engine_weights)
    _assert_same_weights(_saved_model_weights(resumed_dir / "final"), engine_weights)
    print(f"\nTrainer ZeRO-{stage}, {procs} process(es): losses {straight['history']}, "
          f"eval_loss {straight['eval_loss']}; resumed at step {N}: {resumed['trained_here']}")


# ------------------------------------------------- Trainer: Llama, gradient checkpointing, ZeRO-3

LLAMA_GC = Path(__file__).resolve().parents[2] / "data" / "deepspeed" / "make_hf_llama_checkpointing.py"


def test_trainer_llama_gradient_checkpointing_zero3_equals_deepspeed(alias, tmp_path):
    """A tiny LlamaForCausalLM with ``gradient_checkpointing_enable()`` (non-reentrant) at ZeRO-3
    under the Trainer: the losses and grad norms DeepSpeed 0.19.8 logged for the same script
    (tests/data/deepspeed/hf_llama_checkpointing.json). The first backward used to fail with
    'The size of tensor a (0) must match the size of tensor b (64)' (a partitioned weight
    released by the recompute before its gradient was accumulated)."""
    want = json.loads(LLAMA_GC.with_name("hf_llama_checkpointing.json").read_text())
    assert want["deepspeed"] == "0.19.8"
    got = _result(_run(alias, tmp_path, LLAMA_GC.read_text(), ["--print"], 1))
    assert "+dsplug." in got["deepspeed"]  # the alias served it
    assert got["gradient_checkpointing"] and got["zero_stage"] == 3
    assert got["partitioned"] == want["partitioned"] and len(got["partitioned"]) == 16  # every Linear / embedding
    assert len(got["losses"]) == len(want["losses"]) == 6
    assert got["losses"] == pytest.approx(want["losses"], rel=2e-6, abs=2e-6)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=2e-6, abs=2e-6)
    print(f"\nLlama + gradient checkpointing, ZeRO-3: dsplug {got['losses']}\n  DeepSpeed 0.19.8 {want['losses']}")


# ------------------------------------------------------------ Trainer: bf16 at ZeRO-2 / 3 vs DeepSpeed

BF16_TRAINER = Path(__file__).resolve().parents[2] / "data" / "deepspeed" / "make_hf_bf16_trainer.py"


def _bf16_mismatches(got: dict, want: dict) -> list:
    """What differs between a run and one recorded DeepSpeed run (empty: equal)."""
    problems = []
    if len(got["losses"]) != len(want["losses"]) or got["losses"] != pytest.approx(want["losses"], rel=1e-7, abs=0):
        problems.append(f"losses {got['losses']} != {want['losses']}")
    if got["grad_norms"] != pytest.approx(want["grad_norms"], rel=1e-7, abs=0):
        problems.append(f"grad norms {got['grad_norms']} != {want['grad_norms']}")
    if sorted(got["weights"]) != sorted(want["weights"]):
        problems.append("different parameter names")
    else:
        problems += [f"weights of {name}: {got['weights'][name]} != {sums}" for name, sums in want["weights"].items()
                     if got["weights"][name] != pytest.approx(sums, rel=1e-9, abs=1e-9)]
    return problems


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_bf16_equals_deepspeed(alias, tmp_path, stage):
    """A tiny GPT-2 in bf16 under the Trainer, 20 steps with clipping active at each: the losses,
    grad norms and trained weights DeepSpeed 0.19.8 gave (tests/data/deepspeed/hf_bf16_trainer.json).
    bf16 turns a last-bit difference (the norm summed in fp32 instead of fp64, the clip
    coefficient computed in double instead of DeepSpeed's fp32 at stages 1-2, fp32 gradient
    accumulation) into weights that round the other way a few steps later; before those were
    matched the loss differed by up to 1.6e-4 and the weights by up to 6.6e-3 (1.1e-2 with fp32
    accumulation), so the tolerance below is the float printing's, not bf16's.

    The CPU's bf16 kernels move the trajectory the same way (DeepSpeed itself gives losses 1.6e-4
    apart on two kinds of CPU from step 10), so the fixture holds one DeepSpeed recording per kind
    of CPU and the run must equal one of them bit for bit; on a CPU none was recorded on, the
    failure says how to record it."""
    fixture = json.loads(BF16_TRAINER.with_name("hf_bf16_trainer.json").read_text())
    assert fixture["deepspeed"] == "0.19.8" and len(fixture["machines"]) >= 1
    got = _result(_run(alias, tmp_path, BF16_TRAINER.read_text(), ["--stage", str(stage), "--print"], 1))
    assert "+dsplug." in got["deepspeed"] and got["bf16"] and got["zero_stage"] == stage
    assert len(got["losses"]) == fixture["steps"] == 20
    mismatches = {m["cpu"]: _bf16_mismatches(got, m["stages"][str(stage)]) for m in fixture["machines"]}
    equal = [cpu for cpu, problems in mismatches.items() if not problems]
    if not equal:
        sys.path.insert(0, str(BF16_TRAINER.parent))
        from make_hf_bf16_trainer import cpu_description

        report = "\n".join(f"  recorded on {cpu}: {problems[0][:300]}" for cpu, problems in mismatches.items())
        pytest.fail(f"bf16 Trainer ZeRO-{stage} equals none of DeepSpeed 0.19.8's recordings:\n{report}\n"
                    f"this CPU: {cpu_description()}; if none was recorded on this kind of CPU, record DeepSpeed's "
                    f"run with {BF16_TRAINER.name} (its docstring says how) and compare again")
    print(f"\nbf16 Trainer ZeRO-{stage}: equal to DeepSpeed's run on {equal[0]}; grad_norm at step 1 "
          f"{got['grad_norms'][0]}")


# --------------------------------------------------------------------------------------- Accelerate


# (ZeRO-2 over 2 processes is the Trainer's test above; left out here to keep the file's cost down)
@pytest.mark.parametrize("stage, procs", [(2, 1), (3, 1), pytest.param(3, 2, marks=pytest.mark.multiprocess)])
def test_accelerate_deepspeed_plugin(alias, tmp_path, stage, procs):
    args = ["--stage", str(stage), "--out", str(tmp_path)]
    straight = _result(_run(alias, tmp_path, ACCELERATE_SCRIPT, [*args, "--mode", "straight"], procs,
                            launcher="torchrun"))
    assert straight["type"] == "DistributedType.DEEPSPEED" and straight["world"] == procs
    assert straight["gas"] == 2 and straight["zero_stage"] == stage
    assert straight["train_batch_size"] == 2 * 2 * procs

    # gradient accumulation 2: 12 micro-batches -> 6 optimizer steps, each at the second micro-batch
    assert straight["second"][0][1:] == straight["first"][-1][1:]  # (save_state in between changes nothing)
    seq = straight["first"] + straight["second"][1:]  # the start, then one row per micro-batch
    assert [r[1] for r in seq[1:]] == [False, True] * 6  # accelerator.sync_gradients
    assert [r[2] for r in seq[1:]] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]  # engine.global_steps
    for before, row in zip(seq, seq[1:]):  # the LR scheduler moves at the optimizer steps only
        assert (row[3] != before[3]) == row[1], seq
    rows = seq[1:]

    # get_state_dict: the full model, equal to the engine's (gathered) weights
    assert straight["sd_mismatch"] == [] and "transformer.wte.weight" in straight["state_dict_keys"]

    # save_state / load_state in a fresh process: the continued training equals the uninterrupted one
    resumed = _result(_run(alias, tmp_path, ACCELERATE_SCRIPT, [*args, "--mode", "resume"], procs,
                           launcher="torchrun"))
    assert resumed["second"] == straight["second"]  # incl. the restored step count and LR before the first batch
    assert resumed["checksum"] == straight["checksum"] and resumed["sd_mismatch"] == []
    print(f"\nAccelerate ZeRO-{stage}, {procs} process(es): losses {[r[0] for r in rows]}; "
          f"after load_state: {[r[0] for r in resumed['second'][1:]]}")


# ------------------------------------------------------------------------------ CPU world size trap

PROBE = '''
import json, os, sys
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.state import AcceleratorState


def probe(how):
    if how == "PartialState(cpu=True)":
        PartialState(cpu=True)
    elif how == "ACCELERATE_USE_CPU=1":
        os.environ["ACCELERATE_USE_CPU"] = "1"
    accelerator = Accelerator(cpu=how == "Accelerator(cpu=True)", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    seen = {"type": str(accelerator.distributed_type), "world": accelerator.num_processes,
            "deepspeed": accelerator.state.deepspeed_plugin is not None}
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.pop("ACCELERATE_USE_CPU", None)
    return seen


result = {how: probe(how) for how in sys.argv[1:]}
if os.environ.get("RANK", "0") == "0":  # (is_main_process is true on every rank when accelerate counts one process)
    print("RESULT", json.dumps(result))
'''


@pytest.mark.multiprocess
def test_cpu_world_size_setting(alias, tmp_path):
    """On a CPU-only host accelerate counts the processes only with ``PartialState(cpu=True)`` made first."""
    seen = _result(_run(alias, tmp_path, PROBE, ["plain"], 2, launcher="torchrun"))
    seen.update(_result(_run(alias, tmp_path, PROBE, ["PartialState(cpu=True)"], 2, launcher="torchrun")))
    # the trap: DeepSpeed on, but one process counted, so accelerate's "auto" train_batch_size comes out
    # world-size times too small (DeepSpeed and dsplug then refuse the config)
    assert seen["plain"] == {"type": "DistributedType.DEEPSPEED", "world": 1, "deepspeed": True}
    # the setting: every process counted (gloo), DeepSpeed on
    assert seen["PartialState(cpu=True)"] == {"type": "DistributedType.DEEPSPEED", "world": 2, "deepspeed": True}
    # the look-alikes drop DeepSpeed without a word (plain DDP / a single process instead)
    lookalikes = _result(_run(alias, tmp_path, PROBE, ["Accelerator(cpu=True)", "ACCELERATE_USE_CPU=1"], 1))
    for how, got in lookalikes.items():
        assert got == {"type": "DistributedType.NO", "world": 1, "deepspeed": False}, how


# ------------------------------------------------------------------------------------ opt-in only

DETECT = '''
import importlib.util, json
import accelerate.utils, transformers.integrations
print("RESULT", json.dumps({"spec": importlib.util.find_spec("deepspeed") is not None,
                            "accelerate": bool(accelerate.utils.is_deepspeed_available()),
                            "transformers": bool(transformers.integrations.is_deepspeed_available())}))
'''


def test_hf_sees_deepspeed_only_while_the_alias_is_enabled(tmp_path):
    target = tmp_path / "alias"

    def detect():
        return _result(_run(target, tmp_path, DETECT, [], 1))

    def alias(action):
        proc = subprocess.run([sys.executable, "-m", "dsplug.cli", "deepspeed-alias", action, "--target", str(target)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    assert detect() == {"spec": False, "accelerate": False, "transformers": False}
    alias("enable")
    assert detect() == {"spec": True, "accelerate": True, "transformers": True}
    alias("disable")
    assert detect() == {"spec": False, "accelerate": False, "transformers": False}
