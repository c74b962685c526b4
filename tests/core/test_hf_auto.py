"""Hugging Face-style configs full of "auto": filled by fill_auto, resolved at initialize."""
from __future__ import annotations

import types

import pytest
import torch

import dsplug
from dsplug.config import ConfigError, fill_auto

HF_TEMPLATE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 8},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

TRAINER_ARGS = {  # what the HF Trainer fills from its TrainingArguments
    "fp16.enabled": False, "bf16.enabled": True, "lr": 5e-4, "betas": [0.9, 0.999], "eps": 1e-8,
    "weight_decay": 0.0, "warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 10,
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
}


class HFLikeModel(torch.nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.net = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.net(x)


def test_filled_template_initializes_and_derives_the_rest():
    config = fill_auto(HF_TEMPLATE, TRAINER_ARGS)
    engine, optimizer, _, scheduler = dsplug.initialize(model=HFLikeModel(32), config=config)
    assert engine.train_batch_size() == 8  # 4 × 2 × world 1
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    zero = engine.config.section("zero_optimization")
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) \
        == (32 * 32, int(0.9 * 32 * 32), 10 * 32)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert engine.gradient_clipping() == 1.0
    assert type(scheduler).__name__ == "WarmupLR"


def test_unfilled_auto_is_an_error_naming_each_key():
    config = fill_auto(HF_TEMPLATE, {k: v for k, v in TRAINER_ARGS.items() if k not in ("lr", "warmup_max_lr")})
    with pytest.raises(ConfigError) as err:
        dsplug.initialize(model=HFLikeModel(), config=config)
    paths = {issue.path for issue in err.value.issues}
    assert paths == {"optimizer.params.lr", "scheduler.params.warmup_max_lr"}
    assert 'optimizer.params.lr: "auto" is not resolved' in str(err.value)


def test_hidden_size_autos_need_a_model_config():
    config = fill_auto(HF_TEMPLATE, TRAINER_ARGS)
    with pytest.raises(ConfigError, match=r'zero_optimization\.reduce_bucket_size: "auto" is not resolved'):
        dsplug.initialize(model=torch.nn.Linear(4, 4), config=config)


def test_template_passes_config_check_unfilled(tmp_path, capsys):
    import json

    from dsplug.cli import main

    path = tmp_path / "hf.json"
    path.write_text(json.dumps(HF_TEMPLATE))
    assert main(["config", "check", str(path)]) == 0
