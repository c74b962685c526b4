"""``deepspeed.runtime.precision_config`` and DeepSpeed's wrapper-optimizer class names."""
from __future__ import annotations

import pytest
import torch

from dsplug.config import ConfigError


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_get_bfloat16_config_reads_either_spelling(key):
    from dsplug.runtime.precision_config import get_bfloat16_config

    conf = get_bfloat16_config({key: {"enabled": True, "check_grad_overflow": True}})
    assert conf.enabled is True and conf.check_grad_overflow is True
    assert get_bfloat16_config({}).enabled is False


def test_precision_config_errors_name_the_key():
    from dsplug.runtime.precision_config import get_bfloat16_config, get_float16_config

    with pytest.raises(ConfigError, match="keep only 'bf16'"):
        get_bfloat16_config({"bf16": {}, "bfloat16": {}})
    with pytest.raises(ConfigError, match="bf16.enable"):
        get_bfloat16_config({"bf16": {"enable": True}})
    assert get_float16_config({"fp16": {"enabled": True, "loss_scale": 128}}).loss_scale == 128


def test_wrapper_optimizer_names_import_never_match_and_refuse_construction():
    import dsplug
    from dsplug.runtime.bf16_optimizer import BF16_Optimizer
    from dsplug.runtime.fp16.fused_optimizer import FP16_Optimizer
    from dsplug.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from dsplug.unavailable import NotAvailableInDsplug

    engine, optimizer, _, _ = dsplug.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 1, "optimizer": {"type": "Adam"}, "bf16": {"enabled": True}})
    for cls in (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer):
        assert not isinstance(engine.optimizer, cls)
        with pytest.raises(NotAvailableInDsplug, match="engine.optimizer has the wrapper's shape without being one"):
            cls(optimizer)
    assert isinstance(engine.optimizer.optimizer, torch.optim.Optimizer)
