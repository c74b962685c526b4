"""DeepSpeed 0.19.8 training a tiny Llama under the Hugging Face Trainer with gradient
checkpointing (transformers' default, non-reentrant ``torch.utils.checkpoint``) at ZeRO-3, for
tests/plugins/deepspeed_alias/test_huggingface.py.

DeepSpeed is a black box here, never a dependency. It runs in a separate virtual environment that
has DeepSpeed but not transformers / accelerate; ``--site`` appends a site-packages folder that has
them (same torch) to ``sys.path``::

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(mktemp -d) /work/venvs/ds/bin/python \\
        tests/data/deepspeed/make_hf_llama_checkpointing.py --site /work/venv-deps/lib/python3.11/site-packages

writes ``hf_llama_checkpointing.json``: the Trainer's logged loss and grad_norm of every step. The
test runs this same file with dsplug's ``deepspeed`` alias on the path and ``--print``, and compares.
The model is built from a config (nothing downloaded) and the data is random token ids.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "hf_llama_checkpointing.json")
STEPS = 6


def train(out_dir: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, seq=16, vocab=64, seed=0):
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, vocab, (n, seq), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}

    # the Hugging Face guide's ZeRO-3 "auto" template, less the CPU offload (DeepSpeed's CPU Adam
    # would need a compiler); torch_adam: DeepSpeed's AdamW is torch's
    ds_config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config, use_cpu=True, seed=0, report_to="none", disable_tqdm=True,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.01,
        warmup_steps=2, max_steps=STEPS, logging_steps=1, save_strategy="no", eval_strategy="no",
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()  # transformers' default: use_reentrant=False
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64))
    trainer.train()
    engine = trainer.model_wrapped
    partitioned = sorted(n for n, p in engine.module.named_parameters() if p.ds_numel != p.numel())
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "loss" in h],
            "gradient_checkpointing": engine.module.is_gradient_checkpointing,
            "zero_stage": trainer.accelerator.deepspeed_config["zero_optimization"]["stage"],
            "partitioned": partitioned}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", help="a site-packages folder with transformers and accelerate (appended)")
    parser.add_argument("--print", action="store_true", help="print the result as 'RESULT <json>' instead")
    a = parser.parse_args()
    if a.site:
        sys.path.append(a.site)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(key, value)  # one process, no launcher (DeepSpeed would look for MPI)
    import deepspeed

    with tempfile.TemporaryDirectory() as out_dir:
        result = {"deepspeed": deepspeed.__version__, **train(out_dir)}
    if a.print:
        print("RESULT", json.dumps(result))
        return
    with open(FIXTURE, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
