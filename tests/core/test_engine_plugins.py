"""Config-selected optimizer and scheduler plugins inside the engine, against torch.optim and
closed-form schedules, on 1 process and on 2 processes over gloo."""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.engine_common import assert_close_runs, dsplug_run, reference_run

OPTIMIZERS = {
    # config optimizer section -> the torch.optim equivalent the reference uses
    "Adam": ({"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}},  # decoupled (adam_w_mode default)
             lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "Adam-L2": ({"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}},
                lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
    "AdamW": ({"type": "adamw", "params": {"lr": 3e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.01}},
              lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)),
    "SGD": ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True}},
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    "Adagrad": ({"type": "Adagrad", "params": {"lr": 0.05}}, lambda p: torch.optim.Adagrad(p, lr=0.05)),
    "RMSprop": ({"type": "RMSprop", "params": {"lr": 1e-3, "alpha": 0.9}},
                lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9)),
}
BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "steps_per_print": 1000}


def _reference(name, world, steps=3):
    return reference_run(steps, world, 4, 2, OPTIMIZERS[name][1], clip=0.5)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_plugin_equals_torch_optim_single_process(name):
    got = dsplug_run({**BASE, "optimizer": OPTIMIZERS[name][0]}, 3)
    assert_close_runs(got, _reference(name, 1), rtol=1e-5, atol=1e-6)


def _run_all_optimizers():
    return {name: dsplug_run({**BASE, "optimizer": cfg}, 3) for name, (cfg, _) in OPTIMIZERS.items()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_optimizer_plugins_equal_torch_optim_on_two_processes():
    results = run_distributed(_run_all_optimizers, 2)
    for name in OPTIMIZERS:
        want = _reference(name, 2)
        for rank_result in results:
            assert_close_runs(rank_result[name], want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- schedulers
def warmup_decay(k, lo=0.0, hi=0.1, warm=4, total=10):
    """DeepSpeed WarmupDecayLR (linear warmup): lr of iteration k."""
    if k < warm:
        return lo + (hi - lo) * k / warm
    return lo + (hi - lo) * max(0.0, (total - k) / (total - warm))


def range_test(k, lo=0.01, size=2, rate=0.5):
    """DeepSpeed LRRangeTest, continuous: lr of iteration k = min · (1 + rate · (k + 1) / step_size)."""
    return lo * (1 + rate * (k + 1) / size)


def warmup_cosine(k, base=0.1, warm=3, total=8, min_ratio=0.0, cos_min=0.01):
    """DeepSpeed WarmupCosineLR with linear warmup, as a ratio of the optimizer's base lr."""
    if k < warm:
        ratio = min_ratio + (1 - min_ratio) * k / warm
    else:
        progress = min(1.0, (k - warm + 1) / (total - warm))
        ratio = cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress))
    return base * ratio


SCHEDULERS = {
    "WarmupDecayLR": ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                          "warmup_num_steps": 4, "total_num_steps": 10,
                                                          "warmup_type": "linear"}}, warmup_decay),
    "LRRangeTest": ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2,
                                                      "lr_range_test_step_rate": 0.5}}, range_test),
    "WarmupCosineLR": ({"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 3,
                                                            "cos_min_ratio": 0.01, "warmup_type": "linear"}},
                       warmup_cosine),
}


def _scheduler_lrs(name):
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "scheduler": SCHEDULERS[name][0],
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    return dsplug_run(config, 9)["lrs"]


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_plugin_follows_closed_form_once_per_step(name):
    formula = SCHEDULERS[name][1]
    # after optimizer step k (1-based) the scheduler has stepped k times: the lr of iteration k - 1
    expected = [formula(k - 1) for k in range(1, 10)]
    assert _scheduler_lrs(name) == pytest.approx(expected, rel=1e-6, abs=1e-9)


def _all_scheduler_lrs():
    return {name: _scheduler_lrs(name) for name in SCHEDULERS}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_scheduler_plugins_on_two_processes():
    for rank_result in run_distributed(_all_scheduler_lrs, 2):
        for name, lrs in rank_result.items():
            assert lrs == pytest.approx([SCHEDULERS[name][1](k - 1) for k in range(1, 10)], rel=1e-6, abs=1e-9)
