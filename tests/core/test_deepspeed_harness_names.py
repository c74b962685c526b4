"""Kernel names DeepSpeed's own test harness and scripts import: ``deepspeed.ops.__compatible_ops__``,
``runtime.config_utils.DeepSpeedConfigModel``, ``utils.torch``, ``utils.timer``, ``runtime.utils``,
``utils.RepeatingLoader``, ``ops.lion.FusedLion``, the optimizer names of ``runtime.config``, and
the tag-mismatch error type."""
from __future__ import annotations

from typing import List, Optional

import pytest
import torch

import dsplug


# ------------------------------------------------------------------ ops.__compatible_ops__
def test_compatible_ops_names_every_builder_and_says_what_runs_here():
    from dsplug.ops import op_builder

    ops = dsplug.ops.__compatible_ops__
    assert ops is dsplug.ops.compatible_ops() or ops == dsplug.ops.compatible_ops()
    # dsplug's native ops load everywhere (native build or pure-torch fallback)
    for name in ("cpu_adam", "cpu_adagrad", "cpu_lion", "async_io"):
        assert ops[name] is True
    # DeepSpeed's FusedAdam runs on torch's kernels: the Adam optimizer works, so its name is usable
    assert ops[op_builder.FusedAdamBuilder.NAME] is True
    # CUDA-only ops dsplug does not have
    assert ops[op_builder.FusedLambBuilder.NAME] is False
    assert ops[op_builder.TransformerBuilder.NAME] is False
    with pytest.raises(op_builder.OpUnavailableError):
        op_builder.TransformerBuilder().load()


# ------------------------------------------------------------------ config_utils
def _model():
    pytest.importorskip("pydantic")  # an extra: dsplug[pydantic]
    from pydantic import Field

    from dsplug.runtime.config_utils import DeepSpeedConfigModel

    class Conf(DeepSpeedConfigModel):
        size: int = 0
        old_names: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "names",
                                                                   "new_param_fn": lambda v: v.split(",")})
        names: Optional[List[str]] = None
        rate: float = Field(1.0, alias="rate_alias")

    return Conf


def test_config_model_moves_a_deprecated_field_with_a_warning():
    Conf = _model()
    with pytest.warns(DeprecationWarning, match="'old_names' is deprecated, use 'names'"):
        conf = Conf(old_names="a,b")
    assert conf.names == ["a", "b"]


def test_config_model_refuses_a_deprecated_field_with_its_replacement():
    with pytest.raises(AssertionError, match="keep only 'names'"):
        _model()(old_names="a", names=["b"])


def test_config_model_is_strict_and_takes_aliases():
    from pydantic import ValidationError

    Conf = _model()
    assert Conf(rate_alias=2.0).rate == 2.0 and Conf(rate=3.0).rate == 3.0
    with pytest.raises(ValidationError):
        Conf(sise=1)  # unknown key
    with pytest.raises(ValidationError):
        Conf(size="many")
    assert Conf(size="auto").size == 0  # "auto" means the default unless strict


# ------------------------------------------------------------------ utils.torch / timer / runtime.utils
def test_required_torch_version_compares_major_minor():
    from dsplug.utils.torch import required_torch_version

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=f"{major}.{minor}")
    assert required_torch_version(min_version=1.8, max_version=(major, minor))
    assert not required_torch_version(min_version=f"{major + 1}.0")
    assert not required_torch_version(max_version=f"{major}.{minor - 1}" if minor else f"{major - 1}.99")


def test_trim_mean_drops_both_tails_and_leaves_the_input_alone():
    from dsplug.utils.timer import trim_mean

    data = [100.0, 1.0, 2.0, 3.0, -50.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert trim_mean(data, 0.1) == pytest.approx(sum([1, 2, 3, 4, 5, 6, 7, 8]) / 8)
    assert data[0] == 100.0 and data[4] == -50.0
    assert trim_mean([], 0.1) == 0.0
    with pytest.raises(ValueError, match="trim_percent"):
        trim_mean(data, 0.5)


def test_see_memory_usage_logs_only_when_forced(capfd):
    from dsplug.runtime.utils import see_memory_usage

    see_memory_usage("quiet")
    see_memory_usage("checkpoint A", force=True)
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "quiet" not in text and "checkpoint A" in text and "memory allocated" in text


def test_repeating_loader_is_importable_from_utils():
    from dsplug.dataloader import RepeatingLoader
    from dsplug.utils import RepeatingLoader as from_utils

    assert from_utils is RepeatingLoader
    it = iter(from_utils([1, 2]))
    assert [next(it) for _ in range(5)] == [1, 2, 1, 2, 1]


# ------------------------------------------------------------------ FusedLion
def _lion_reference(p, grads, lr, betas, wd, storage=torch.float64):
    """Lion in fp32 arithmetic, the parameter and momentum stored in ``storage`` between steps."""
    p, m = p.clone().to(storage), torch.zeros_like(p, dtype=storage)
    for g in grads:
        g, pf, mf = g.float(), p.float(), m.float()
        update = torch.sign(betas[0] * mf + (1 - betas[0]) * g)
        p = (pf * (1 - lr * wd) - lr * update).to(storage)
        m = (betas[1] * mf + (1 - betas[1]) * g).to(storage)
    return p.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lion_matches_the_formula(dtype):
    from dsplug.ops.lion import FusedLion

    torch.manual_seed(0)
    start = torch.randn(33)
    grads = [torch.randn(33) for _ in range(6)]
    p = torch.nn.Parameter(start.clone().to(dtype))
    opt = FusedLion([p], lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for g in grads:
        p.grad = g.to(dtype)
        opt.step()
    expected = _lion_reference(start.to(dtype), [g.to(dtype) for g in grads], 0.01, (0.8, 0.95), 0.1,
                               storage=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(p.detach().double(), expected, atol=tol, rtol=0)
    assert opt.state[p]["step"] == 6


def test_fused_lion_agrees_with_the_native_cpu_lion():
    from dsplug.ops.lion import DeepSpeedCPULion, FusedLion

    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.randn(257))
    b = torch.nn.Parameter(a.detach().clone())
    fa, fb = FusedLion([a], lr=1e-3, weight_decay=0.01), DeepSpeedCPULion([b], lr=1e-3, weight_decay=0.01)
    for _ in range(5):
        g = torch.randn(257)
        a.grad, b.grad = g.clone(), g.clone()
        fa.step()
        fb.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=0)


def test_fused_lion_refuses_bad_hyperparameters():
    from dsplug.ops.lion import FusedLion

    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        FusedLion(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        FusedLion(p, lr=-1.0)


# ------------------------------------------------------------------ runtime.config optimizer names
def test_runtime_config_has_the_optimizer_names_that_select_the_optimizers():
    from dsplug.registry import get_registry
    from dsplug.runtime import config

    assert (config.ADAM_OPTIMIZER, config.ADAMW_OPTIMIZER, config.LAMB_OPTIMIZER) == ("adam", "adamw", "lamb")
    assert config.TORCH_ADAM_PARAM == "torch_adam" and config.ADAM_W_MODE == "adam_w_mode"
    registry = get_registry()
    for name in (config.ADAM_OPTIMIZER, config.ADAMW_OPTIMIZER, config.LAMB_OPTIMIZER, config.ADAGRAD_OPTIMIZER):
        assert registry.find("optimizer", name) is not None, name
    assert "ADAM_OPTIMIZER" in dir(config) and config.DeepSpeedConfig is not None


# ------------------------------------------------------------------ checkpoint tags
def test_a_tag_mismatch_is_a_checkpoint_error_and_an_assertion_error():
    from dsplug.checkpoint import CheckpointError, TagMismatchError

    assert issubclass(TagMismatchError, CheckpointError) and issubclass(TagMismatchError, AssertionError)


# ------------------------------------------------------------------ errors crossing processes
def _raise_config_error():
    from dsplug.config.schema import ConfigError, Issue

    raise ConfigError([Issue("optimizer.params.lr", "must be >= 0"), Issue("train_batch_size", "missing")], "x.json")


def test_a_config_error_raised_in_a_worker_process_arrives_whole():
    """DeepSpeed's test harness runs tests in a multiprocessing pool: the parent re-raises the
    worker's exception from its pickle, which must keep the issues (not the text's characters)."""
    import multiprocessing

    from dsplug.config.schema import ConfigError

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(ConfigError) as info:
            pool.apply(_raise_config_error)
    assert [str(i) for i in info.value.issues] == ["optimizer.params.lr: must be >= 0", "train_batch_size: missing"]
    assert info.value.source == "x.json" and str(info.value).startswith("invalid dsplug config (x.json): 2 errors")
    assert [str(i) for i in ConfigError("one message").issues] == ["one message"]


# ------------------------------------------------------------------ DeepSpeedConfig batch re-resolution
def test_configure_train_batch_size_resolves_what_is_set_and_asserts_on_a_misfit():
    from dsplug.runtime.config import DeepSpeedConfig

    conf = DeepSpeedConfig({"train_batch_size": 8}, world_size=2)
    conf.train_batch_size, conf.train_micro_batch_size_per_gpu, conf.gradient_accumulation_steps = 32, 8, None
    conf._configure_train_batch_size()
    assert (conf.train_batch_size, conf.train_micro_batch_size_per_gpu, conf.gradient_accumulation_steps) == (32, 8, 2)
    conf.train_batch_size, conf.train_micro_batch_size_per_gpu, conf.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(AssertionError, match="train_batch_size=33"):
        conf._configure_train_batch_size()
    assert conf.train_batch_size == 33  # left as set


def test_initialize_without_a_model_is_a_value_error_and_an_assertion_error():
    with pytest.raises(ValueError, match="model is required") as info:
        dsplug.initialize(model=None, config={"train_batch_size": 1})
    assert isinstance(info.value, AssertionError)
    with pytest.raises(AssertionError, match="first positional argument is args"):
        dsplug.initialize(torch.nn.Linear(2, 2), config={"train_batch_size": 1})
