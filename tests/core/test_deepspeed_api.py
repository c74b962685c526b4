"""DeepSpeed's public import paths and engine methods that Hugging Face Transformers / Accelerate
and DeepSpeed scripts use, mapped onto dsplug: every path imports, every name behaves.

Numeric checks where behaviour matters: ``safe_get_full_*`` against the stage's own master
weights / gradients / optimizer state at stages 0-3 (and 2 processes at stage 3), the
accelerate-style ``set_gradient_accumulation_boundary`` loop against the plain loop, the config
mapping against the resolved dict, ``clone_tensors_for_torch_save`` storage independence,
``_zero3_consolidated_16bit_state_dict`` against the module's state dict.
"""
from __future__ import annotations

import collections
import io
import os
import subprocess
import sys
from collections import abc

import pytest
import torch

import dsplug
from dsplug import comm

from tests.conftest import scaled
from tests.dist_harness import run_distributed
from tests.engine_common import batch, loss_fn, make_model

STAGES = (0, 1, 2, 3)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def cfg(stage: int, gas: int = 1, micro: int = 4, precision=None, **zero) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
              "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage, **zero}}
    if stage == 3:
        config["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
    if precision:
        config[precision] = {"enabled": True}
    return config


def build(config, model=None, optimizer=adamw):
    engine, *_ = dsplug.initialize(model=model if model is not None else make_model(), optimizer=optimizer,
                                   config=config)
    return engine


def micro_step(engine, step: int, micro: int = 0, rank: int = 0, size: int = 4):
    x, y = batch(step, micro, rank, size)
    loss = loss_fn(engine(x.to(engine.precision.model_dtype)), y)
    engine.backward(loss)
    return float(loss.detach())


def full_params(engine):
    from dsplug.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p) for p in engine.module.parameters()]


# ============================================================================ import paths
def test_runtime_is_reachable_as_attributes_right_after_import():
    code = ("import dsplug as deepspeed\n"
            "print(deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES)\n"
            "print(deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE)\n"
            "print(deepspeed.utils.logger.name, deepspeed.checkpoint.utils.clone_tensors_for_torch_save.__name__)\n"
            "print(deepspeed.launcher.runner.encode_world_info({}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    assert "WarmupLR" in out.stdout and "NOT_AVAILABLE" in out.stdout and "clone_tensors_for_torch_save" in out.stdout


@pytest.mark.parametrize("path, names", [
    ("dsplug.runtime.config", ["DeepSpeedConfig", "DeepSpeedConfigError", "TRAIN_BATCH_SIZE", "ZERO_OPTIMIZATION"]),
    ("dsplug.runtime.constants", ["TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS", "FP16"]),
    ("dsplug.runtime.lr_schedules", ["WarmupLR", "VALID_LR_SCHEDULES"]),
    ("dsplug.runtime.zero.config", ["DeepSpeedZeroConfig", "ZeroStageEnum", "DeepSpeedZeroOffloadParamConfig",
                                    "DeepSpeedZeroOffloadOptimizerConfig", "OffloadDeviceEnum"]),
    ("dsplug.runtime.zero.partition_parameters", ["Init", "GatheredParameters", "ZeroParamStatus", "ZeroParamType",
                                                  "register_external_parameter", "unregister_external_parameter",
                                                  "is_zero_param", "shutdown_init_context",
                                                  "restore_init_context"]),
    ("dsplug.runtime.fp16.loss_scaler", ["LossScaler", "DynamicLossScaler", "LossScalerBase", "CreateLossScaler",
                                         "INITIAL_LOSS_SCALE"]),
    ("dsplug.checkpoint.utils", ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank",
                                 "get_zero_ckpt_name_for_rank"]),
    ("dsplug.checkpoint.constants", ["OPTIMIZER_STATE_DICT", "FP32_FLAT_GROUPS", "ZERO_STAGE", "PARAM_SHAPES",
                                     "MODEL_FILE_PREFIX", "ZERO_FILE_PREFIX", "OPTIM_FILE_SUFFIX",
                                     "MODEL_FILE_SUFFIX", "DS_VERSION"]),
    ("dsplug.checkpoint", ["atomic_save", "load_file", "CheckpointError", "optim_file", "MODEL_FILE"]),
    ("dsplug.utils", ["logger", "log_dist", "groups", "zero_to_fp32", "safe_get_full_fp32_param",
                      "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param",
                      "safe_set_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules",
                      "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]),
    ("dsplug.utils.groups", ["_get_data_parallel_world_size", "_get_data_parallel_rank", "_get_data_parallel_group",
                             "get_data_parallel_group", "_get_sequence_parallel_world_size",
                             "_get_model_parallel_world_size", "_get_broadcast_src_rank"]),
    ("dsplug.utils.z3_leaf_module", ["set_z3_leaf_modules", "z3_leaf_module", "get_z3_leaf_modules"]),
    ("dsplug.accelerator", ["get_accelerator", "set_accelerator", "DeepSpeedAccelerator",
                            "is_current_accelerator_supported"]),
    ("dsplug.ops.op_builder", ["CPUAdamBuilder", "AsyncIOBuilder", "FusedAdamBuilder", "TransformerBuilder"]),
    ("dsplug.launcher.runner", ["fetch_hostfile", "parse_resource_filter", "parse_inclusion_exclusion",
                                "encode_world_info", "main", "parse_args", "DLTS_HOSTFILE"]),
    ("dsplug.comm", ["get_world_size", "get_rank", "get_local_rank", "barrier", "all_reduce", "all_gather",
                     "broadcast", "init_distributed", "is_initialized", "ReduceOp", "new_group", "get_world_group",
                     "inference_all_reduce", "is_available", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "get_global_rank", "monitored_barrier", "all_to_all_single", "send", "recv",
                     "broadcast_object_list", "has_all_gather_into_tensor", "has_reduce_scatter_tensor"]),
    ("dsplug", ["DeepSpeedConfigError", "DeepSpeedConfig", "initialize", "init_distributed", "runtime", "utils",
                "checkpoint", "launcher", "comm", "zero", "ops", "accelerator"]),
])
def test_path_imports_and_names_exist(path, names):
    import importlib

    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == []


def test_deepspeed_config_error_is_the_config_error():
    assert dsplug.DeepSpeedConfigError is dsplug.ConfigError
    with pytest.raises(dsplug.DeepSpeedConfigError, match="train_batch_sz"):
        dsplug.DeepSpeedConfig({"train_batch_sz": 1})


def test_z3_leaf_module_attribute_is_the_function():
    from dsplug.utils import z3_leaf_module

    assert callable(z3_leaf_module) and not isinstance(z3_leaf_module, type(sys))
    assert z3_leaf_module(torch.nn.Linear(1, 1)) is False


# ============================================================================ config
def test_engine_config_is_a_read_only_mapping_over_the_resolved_dict():
    engine = build(cfg(2, gas=2, precision="bf16", reduce_bucket_size=1000))
    config = engine.config
    resolved = config.to_dict()
    assert isinstance(config, abc.Mapping)
    assert dict(config) == resolved and len(config) == len(resolved) and set(config) == set(resolved)
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert config["bf16"]["enabled"] is True
    assert config.get("fp16", {}) == {} and "fp16" not in config and "zero_optimization" in config
    assert config["train_batch_size"] == 8 and config.get("gradient_accumulation_steps") == 2
    with pytest.raises(KeyError):
        config["fp16"]
    config.get("zero_optimization")["stage"] = 99  # a copy: the config does not change
    assert config["zero_optimization"]["stage"] == 2
    # the parsed parts are still attributes
    assert config.kernel.gradient_accumulation_steps == 2 and config.train_batch_size == 8
    assert config.section("zero_optimization").stage == 2 and config.sections["bf16"].enabled is True
    assert hash(config) == object.__hash__(config)  # usable as a key, as before
    engine.destroy()


def test_deepspeed_config_answers_deepspeeds_attribute_names(tmp_path):
    import json

    from dsplug.runtime.config import DeepSpeedConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "gradient_accumulation_steps": 2,
                                "fp16": {"enabled": True, "initial_scale_power": 8},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                      "stage3_gather_16bit_weights_on_model_save": True}}))
    c = DeepSpeedConfig(str(path), world_size=2)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (16, 4, 2)
    assert c.zero_optimization_stage == 3 and c.zero_enabled
    assert c.fp16_enabled and not c.bf16_enabled and not c.bfloat16_enabled and not c.amp_enabled
    assert c.initial_dynamic_scale == 2 ** 8 and c.dynamic_loss_scale_args["init_scale"] == 2 ** 8
    assert c.optimizer_name == "adamw" and c.optimizer_params == {**c.optimizer_params, "lr": 1e-3}
    zero = c.zero_config
    assert zero.stage == 3 and zero.stage is zero.stage.weights
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.offload_param.device == "cpu" and zero.offload_optimizer is None
    assert c._param_dict["zero_optimization"]["stage"] == 3
    auto = DeepSpeedConfig({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                            "gradient_accumulation_steps": "auto",
                            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}})
    assert auto.train_batch_size == "auto" and auto.zero_optimization_stage == 2
    assert auto.zero_config.reduce_bucket_size == "auto"


def test_zero_config_models_parse_strictly_under_deepspeeds_names():
    from dsplug.config import ConfigError
    from dsplug.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                            OffloadDeviceEnum, ZeroStageEnum)

    z = DeepSpeedZeroConfig(stage=2, prefetch_bucket_size=123, offload_optimizer={"device": "cpu"})
    assert z.stage == ZeroStageEnum.gradients == 2
    assert z.prefetch_bucket_size == z.stage3_prefetch_bucket_size == 123
    assert z.offload_optimizer.device is OffloadDeviceEnum.cpu and z.cpu_offload and not z.cpu_offload_param
    assert DeepSpeedZeroOffloadOptimizerConfig(device="nvme", nvme_path="/x").device == "nvme"
    with pytest.raises(ConfigError, match="stage"):
        DeepSpeedZeroConfig(stage=7)
    with pytest.raises(ConfigError, match="overlap_com"):
        DeepSpeedZeroConfig(overlap_com=True)
    with pytest.raises(AttributeError):
        z.stage = 1


# ============================================================================ checkpoint utils
def test_clone_tensors_for_torch_save_returns_storage_independent_clones():
    from dsplug.checkpoint.utils import clone_tensors_for_torch_save

    Point = collections.namedtuple("Point", "a b")
    flat = torch.arange(1000, dtype=torch.float32)
    item = {"w": flat[10:20], "nested": [flat[:5], (flat[5:8], 3)], "od": collections.OrderedDict(x=flat[0:2]),
            "pt": Point(flat[3:4], "text"), "n": None}
    out = clone_tensors_for_torch_save(item)
    assert type(out["od"]) is collections.OrderedDict and type(out["nested"][1]) is tuple
    assert type(out["pt"]) is Point and out["pt"].b == "text" and out["nested"][1][1] == 3 and out["n"] is None
    tensors = [out["w"], out["nested"][0], out["nested"][1][0], out["od"]["x"], out["pt"].a]
    originals = [item["w"], item["nested"][0], item["nested"][1][0], item["od"]["x"], item["pt"].a]
    for t, o in zip(tensors, originals):
        assert torch.equal(t, o) and t.device.type == "cpu"
        assert t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    flat.zero_()
    assert float(out["w"].sum()) == float(sum(range(10, 20)))
    buf_clone, buf_view = io.BytesIO(), io.BytesIO()
    torch.save(out["w"], buf_clone)
    torch.save(flat[10:20], buf_view)
    assert len(buf_clone.getvalue()) < len(buf_view.getvalue()) - 3000  # the view drags the whole storage along
    p = torch.nn.Parameter(torch.ones(3))
    cloned = clone_tensors_for_torch_save(p)
    assert not cloned.requires_grad and cloned.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()


def test_checkpoint_name_helpers_match_the_files_dsplug_writes(tmp_path):
    from dsplug import checkpoint
    from dsplug.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank

    assert os.path.basename(get_model_ckpt_name_for_rank(str(tmp_path), "00")) == checkpoint.MODEL_FILE
    assert os.path.basename(get_zero_ckpt_name_for_rank(str(tmp_path), 3, 0)) == checkpoint.optim_file(3)


# ============================================================================ utils
def test_groups_before_and_after_init():
    from dsplug.utils import groups

    assert groups._get_data_parallel_world_size() == comm.get_world_size()
    assert groups._get_data_parallel_rank() == comm.get_rank()
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_model_parallel_world_size() == 1
    comm.init_distributed(verbose=False)
    import torch.distributed as dist

    assert groups._get_data_parallel_group() is dist.group.WORLD is groups.get_data_parallel_group()
    assert comm.get_world_group() is dist.group.WORLD and comm.is_available()
    t = torch.ones(2)
    comm.inference_all_reduce(t)
    assert torch.equal(t, torch.ones(2)) and comm.get_global_rank(None, 0) == 0
    objs = ["mine"]
    comm.broadcast_object_list(objs, src=0)
    assert objs == ["mine"]


def test_logger_and_log_dist(capsys):
    from dsplug.utils import log_dist, logger

    assert logger is __import__("logging").getLogger("dsplug")
    log_dist("hello from the ranks", ranks=[0])
    log_dist("not on this rank", ranks=[5])
    out = capsys.readouterr().out
    assert "[Rank 0] hello from the ranks" in out and "not on this rank" not in out


# ============================================================================ accelerator
def test_accelerator_answers_deepspeeds_interface(monkeypatch):
    from dsplug.accelerator import get_accelerator

    accel = get_accelerator()
    assert accel.current_device_name() == "cpu" and accel.device_name() == "cpu"
    assert accel.communication_backend_name() == "gloo" and accel.is_synchronized_device()
    assert torch.float32 in accel.supported_dtypes() and torch.bfloat16 in accel.supported_dtypes()
    assert accel.is_bf16_supported() and isinstance(accel.is_fp16_supported(), bool)
    for name, dtype in (("FloatTensor", torch.float32), ("HalfTensor", torch.float16), ("BFloat16Tensor", torch.bfloat16),
                        ("LongTensor", torch.int64), ("IntTensor", torch.int32), ("ByteTensor", torch.uint8),
                        ("DoubleTensor", torch.float64)):
        t = getattr(accel, name)([1, 2])
        assert t.dtype == dtype and t.tolist() == [1, 2]
    assert accel.on_accelerator(torch.zeros(1)) and accel.pin_memory(torch.zeros(1)).shape == (1,)
    assert accel.Stream is None and accel.Event is None
    with accel.stream(None):
        pass
    accel.empty_cache()
    accel.synchronize()
    assert accel.random() is torch.random and accel.memory_allocated() > 0 and accel.available_memory() > 0
    accel.manual_seed(3)
    a = torch.rand(2)
    accel.set_rng_state(accel.get_rng_state())
    state = accel.get_rng_state()
    b = torch.rand(2)
    accel.set_rng_state(state)
    assert torch.equal(torch.rand(2), b) and not torch.equal(a, b)
    assert accel.memory_stats()["allocated_bytes.all.current"] > 0
    assert accel.get_compile_backend() == "inductor" and accel.lazy_call(lambda: 5) == 5
    assert accel.create_op_builder("CPUAdamBuilder").NAME == "cpu_adam"
    assert accel.get_op_builder("FusedAdamBuilder")().is_compatible() is False
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert accel.device_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert accel.device_count() == 4 and accel.current_device() == 2


def test_unavailable_op_builders_say_so():
    from dsplug.op_builder import OpUnavailableError
    from dsplug.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

    assert FusedAdamBuilder().is_compatible() is False and FusedAdamBuilder.NAME == "fused_adam"
    with pytest.raises(OpUnavailableError, match="fused_adam"):
        FusedAdamBuilder().load()
    assert hasattr(CPUAdamBuilder().load(), "create_adam") or CPUAdamBuilder().load() is not None


# ============================================================================ launcher runner
def test_runner_hostfile_and_resource_filters(tmp_path):
    from dsplug.launcher import runner

    assert runner.fetch_hostfile(str(tmp_path / "absent")) is None
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=4\n# comment\nworker-1 slots=2\n")
    pool = runner.fetch_hostfile(str(hostfile))
    assert list(pool.items()) == [("worker-0", 4), ("worker-1", 2)]
    assert runner._parse_hostfile(["a slots=1", "b slots=2"]) == {"a": 1, "b": 2}
    active = runner.parse_inclusion_exclusion(pool, "worker-0@worker-1:0", "")
    assert list(active.items()) == [("worker-0", [0, 1, 2, 3]), ("worker-1", [0])]
    assert dict(runner.parse_inclusion_exclusion(pool, "", "worker-0:1,3@worker-1")) == {"worker-0": [0, 2]}
    assert dict(runner.parse_inclusion_exclusion(pool, "worker-1:1", "")) == {"worker-1": [1]}
    assert runner.parse_resource_filter({"a": [0]}) == {"a": [0]}
    with pytest.raises(ValueError, match="mutually exclusive"):
        runner.parse_inclusion_exclusion(pool, "worker-0", "worker-1")
    with pytest.raises(ValueError, match="worker-9"):
        runner.parse_inclusion_exclusion(pool, "worker-9", "")
    with pytest.raises(ValueError, match="slot '5'"):
        runner.parse_inclusion_exclusion(pool, "worker-1:5", "")
    with pytest.raises(ValueError):
        runner._parse_hostfile(["a slots=1", "a slots=2"])
    encoded = runner.encode_world_info({"worker-0": [0, 1]})
    assert runner.decode_world_info(encoded) == {"worker-0": [0, 1]}
    import base64
    import json

    assert json.loads(base64.urlsafe_b64decode(encoded)) == {"worker-0": [0, 1]}


def test_runner_main_is_dsplug_launch(tmp_path, capsys):
    from dsplug.launcher import runner

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert runner.main(["--num_procs", "2", "--print_only", str(script)]) == 0
    assert str(script) in capsys.readouterr().out


# ============================================================================ loss scaler
def test_loss_scalers_follow_deepspeeds_rules():
    from dsplug.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler, LossScaler

    static = LossScaler(scale=8)
    assert static.cur_scale == static.loss_scale == 8 and not static.dynamic
    static.update_scale(True)
    assert static.cur_scale == 8 and static.has_overflow([]) is False
    s = DynamicLossScaler(init_scale=2 ** 4, scale_window=2, min_scale=2, delayed_shift=2)
    assert s.dynamic and s.cur_scale == 16 and s.cur_hysteresis == 2
    s.update_scale(True)  # spends one unit of hysteresis
    assert s.cur_scale == 16 and s.cur_hysteresis == 1
    s.update_scale(True)  # halves
    assert s.cur_scale == 8
    s.update_scale(False)
    s.update_scale(False)  # two overflow-free iterations since the last overflow: doubles
    assert s.cur_scale == 16 and s.cur_iter == 4 and s.last_overflow_iter == 1
    low = DynamicLossScaler(init_scale=2, min_scale=2, delayed_shift=1)
    with pytest.raises(RuntimeError, match="minimum"):
        low.update_scale(True)
    assert DynamicLossScaler(init_scale=2, min_scale=2, raise_error_at_min_scale=False).cur_scale == 2
    assert isinstance(CreateLossScaler(torch.half, 0, True, {"init_scale": 4.0}), DynamicLossScaler)
    assert CreateLossScaler(torch.bfloat16, 128, False).cur_scale == 1.0
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("inf")])
    assert s.has_overflow([p]) is True


# ============================================================================ partition_parameters
def test_shutdown_init_context_builds_whole_modules_until_restored():
    from dsplug.runtime.zero.partition_parameters import (Init, ZeroParamType, is_zero_param, restore_init_context,
                                                          shutdown_init_context, zero_init_enabled)

    assert ZeroParamType.PARTITIONED.value == 2 and not zero_init_enabled()
    with Init():
        assert zero_init_enabled()
        a = torch.nn.Linear(3, 3)
        shutdown_init_context()
        assert not zero_init_enabled()
        b = torch.nn.Linear(3, 3)
        restore_init_context()
        c = torch.nn.Linear(3, 3)
        shutdown_init_context()  # left suspended when the context exits: exiting still restores torch
    assert is_zero_param(a.weight) and not is_zero_param(b.weight) and is_zero_param(c.weight)
    d = torch.nn.Linear(3, 3)
    assert not is_zero_param(d.weight) and not zero_init_enabled()


# ============================================================================ engine: boundary flag
def _accelerate_style(engine, micro_steps: int, gas: int):
    """What Accelerate does: flag every micro-step, step() only when syncing."""
    losses = []
    for i in range(micro_steps):
        sync = (i + 1) % gas == 0
        engine.set_gradient_accumulation_boundary(is_boundary=sync)
        losses.append(micro_step(engine, i // gas, i % gas))
        if sync:
            engine.step()
    return losses


def _plain(engine, micro_steps: int, gas: int):
    losses = []
    for i in range(micro_steps):
        losses.append(micro_step(engine, i // gas, i % gas))
        engine.step()
    return losses


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_set_gradient_accumulation_boundary_drives_steps_like_accelerate(stage):
    gas, micro_steps = 3, 12
    plain = build(cfg(stage, gas=gas))
    plain_losses = _plain(plain, micro_steps, gas)
    flagged = build(cfg(stage, gas=gas))
    flagged_losses = _accelerate_style(flagged, micro_steps, gas)
    assert flagged_losses == plain_losses
    assert flagged.global_steps == plain.global_steps == micro_steps // gas
    assert flagged.global_samples == plain.global_samples
    for a, b in zip(full_params(flagged), full_params(plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a boundary on every micro-step: gas times more optimizer steps than the loops above
    every = build(cfg(stage, gas=gas))
    for i in range(micro_steps):
        every.set_gradient_accumulation_boundary(True)
        micro_step(every, i // gas, i % gas)
        every.step()
    assert every.global_steps == micro_steps == gas * flagged.global_steps
    assert every.is_gradient_accumulation_boundary() is True
    every.set_gradient_accumulation_boundary(False)
    assert every.is_gradient_accumulation_boundary() is False
    for engine in (plain, flagged, every):
        engine.destroy()


def test_without_the_flag_the_accelerate_loop_would_update_too_rarely():
    """The arithmetic boundary counts step() calls; Accelerate calls step() once per window."""
    gas = 2
    engine = build(cfg(0, gas=gas))
    for i in range(4):  # Accelerate's loop minus the flag
        micro_step(engine, i // gas, i % gas)
        if (i + 1) % gas == 0:
            engine.step()
    assert engine.global_steps == 1  # only every second window would update: why the flag is needed
    engine.destroy()


def test_optimizer_overflow_reports_skipped_steps():
    config = cfg(0)
    config["fp16"] = {"enabled": True, "initial_scale_power": 2}
    engine = build(config)
    assert engine.optimizer.overflow is False
    micro_step(engine, 0)
    for p in engine.module.parameters():
        grad = engine.stage._grad_of(p)
        grad.fill_(float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.optimizer.overflow is True
    micro_step(engine, 1)
    engine.step()
    assert engine.optimizer.overflow is False
    engine.destroy()


# ============================================================================ engine: compile
def test_compile_takes_deepspeeds_signature_and_compiles_the_module():
    engine = build(cfg(0))
    x, _ = batch(0, 0, 0, 4)
    before = engine(x).detach()
    with pytest.raises(ValueError, match="unknown torch.compile backend"):
        engine.compile(backend="no-such-backend")
    with pytest.raises(NotImplementedError):
        engine.compile(backend="eager", schedule=[(0, "pass")])
    engine.compile(backend="eager", compile_kwargs={"dynamic": False})
    assert engine.is_compiled and engine.module._compiled_call_impl is not None
    torch.testing.assert_close(engine(x).detach(), before)
    micro_step(engine, 0)
    engine.step()
    assert engine.global_steps == 1
    engine.compile(backend="eager")  # a second call changes nothing
    engine.destroy()


# ============================================================================ engine: 16-bit state dict
@pytest.mark.parametrize("stage", [2, 3])
def test_zero3_consolidated_16bit_state_dict_equals_the_module_state_dict(stage):
    engine = build(cfg(stage, precision="bf16", stage3_gather_16bit_weights_on_model_save=True))
    micro_step(engine, 0)
    engine.step()
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    state = engine._zero3_consolidated_16bit_state_dict()
    if stage == 3:
        from dsplug.zero import GatheredParameters

        params = list(engine.module.parameters())
        with GatheredParameters(params):
            want = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    else:
        want = engine.module.state_dict()
    assert list(state) == list(want)
    for k in want:
        assert state[k].dtype == torch.bfloat16 and state[k].device.type == "cpu"
        assert torch.equal(state[k], want[k]), k
    assert build(cfg(stage)).zero_gather_16bit_weights_on_model_save() is False


# ============================================================================ safe_get_full_* at stages 0-3
def _stage_master(engine, p):
    """The fp32 master weight the stage itself keeps for ``p`` (world of one: all of it)."""
    stage = engine.stage
    if stage.stage == 0:
        return stage.master[p]
    if stage.stage in (1, 2):
        group = next(g for g in stage.groups if p in g.position)
        i = group.position[p]
        return stage.opt_params[group.index][group.offsets[i]:group.offsets[i] + group.numels[i]].view(p.shape)
    gi, i = stage.place[id(p)]
    return stage.groups[gi].views[i][:p.ds_numel].view(p.ds_shape)


@pytest.mark.parametrize("stage", STAGES)
def test_safe_get_full_fp32_param_is_the_master_weight(stage):
    engine = build(cfg(stage, precision="bf16"))
    for s in range(2):
        micro_step(engine, s)
        engine.step()
    fulls = full_params(engine)
    for p, full in zip(engine.module.parameters(), fulls):
        master = _stage_master(engine, p)
        assert full.dtype == torch.float32 and tuple(full.shape) == tuple(getattr(p, "ds_shape", p.shape))
        assert torch.equal(full, master)
        assert full.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()
    # the master is not the bf16 weight: it holds bits the model's copy rounds away
    assert any(not torch.equal(f, f.to(torch.bfloat16).float()) for f in fulls)
    engine.destroy()


def _trained_values(stage: int, gas: int = 2):
    engine = build(cfg(stage, gas=gas))
    from dsplug.utils import safe_get_full_grad, safe_get_full_optimizer_state

    for m in range(gas):  # window 0: then look at the reduced gradients before its last step()
        micro_step(engine, 0, m)
        if m < gas - 1:
            engine.step()
    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
    engine.step()
    exp_avg = [safe_get_full_optimizer_state(p, "exp_avg") for p in engine.module.parameters()]
    step = safe_get_full_optimizer_state(next(engine.module.parameters()), "step")
    params = full_params(engine)
    engine.destroy()
    return grads, exp_avg, step, params


def test_safe_get_full_grad_and_optimizer_state_agree_at_every_stage_and_with_plain_pytorch():
    gas = 2
    model = make_model()
    for m in range(gas):
        x, y = batch(0, m, 0, 4)
        (loss_fn(model(x), y) / gas).backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    opt = adamw(model.parameters())
    opt.step()
    want_exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    want_params = [p.detach().clone() for p in model.parameters()]
    for stage in STAGES:
        grads, exp_avg, step, params = _trained_values(stage, gas)
        assert float(step) == 1.0, stage
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"stage {stage} grad")
        for got, want in zip(exp_avg, want_exp_avg):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"stage {stage} exp_avg")
        for got, want in zip(params, want_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"stage {stage} param")


@pytest.mark.parametrize("stage", STAGES)
def test_safe_set_full_fp32_param_and_optimizer_state(stage):
    from dsplug.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                              safe_set_full_optimizer_state)

    engine = build(cfg(stage, precision="bf16"))
    micro_step(engine, 0)
    engine.step()
    first = next(engine.module.parameters())
    shape = tuple(getattr(first, "ds_shape", first.shape))
    value = torch.linspace(-1, 1, int(torch.tensor(shape).prod())).view(shape)
    safe_set_full_fp32_param(first, value)
    assert torch.equal(safe_get_full_fp32_param(first), value)
    # the next forward computes with the new weight (in the training dtype)
    reference = make_model()
    with torch.no_grad():
        for r, p in zip(reference.parameters(), engine.module.parameters()):
            r.copy_(safe_get_full_fp32_param(p).to(torch.bfloat16).float())
    x, _ = batch(5, 0, 0, 4)
    torch.testing.assert_close(engine(x.to(torch.bfloat16)).float(), reference.to(torch.bfloat16)(
        x.to(torch.bfloat16)).float(), rtol=0, atol=0)
    state = torch.full(shape, 0.25)
    safe_set_full_optimizer_state(first, state, "exp_avg")
    assert torch.equal(safe_get_full_optimizer_state(first, "exp_avg"), state)
    with pytest.raises(ValueError, match="shape"):
        safe_set_full_fp32_param(first, torch.zeros(1, 2, 3))
    engine.destroy()


def test_safe_get_on_a_parameter_no_engine_trains_is_none():
    from dsplug.utils import safe_get_full_fp32_param, safe_get_full_grad

    p = torch.nn.Parameter(torch.ones(2))
    assert safe_get_full_fp32_param(p) is None and safe_get_full_grad(p) is None
    frozen = make_model()
    first = next(frozen.parameters())
    first.requires_grad_(False)
    engine = build(cfg(2), model=frozen)
    assert safe_get_full_fp32_param(first) is None
    engine.destroy()
    assert safe_get_full_fp32_param(next(iter(list(engine.module.parameters())[1:]))) is None  # after destroy


def _dist_stage3_job():
    from dsplug.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
    from dsplug.zero import GatheredParameters

    rank, world = comm.get_rank(), comm.get_world_size()
    engine = build(cfg(3, precision="bf16", micro=2, stage3_gather_16bit_weights_on_model_save=True))
    out = {"rank": rank}
    for s in range(2):
        micro_step(engine, s, 0, rank, 2)
        if s == 1:
            out["grads"] = [safe_get_full_grad(p) for p in engine.module.parameters()]
            out["grad_pieces"] = [engine.stage.groups[engine.stage.place[id(p)][0]].grad_views[
                engine.stage.place[id(p)][1]].float().clone() for p in engine.module.parameters()]
            # DeepSpeed's ZeRO-3 optimizer internals, through engine.optimizer
            parts = engine.optimizer.get_fp32_grad_partitions()
            out["ds_parts"] = [parts[engine.stage.place[id(p)][0]][engine.stage.place[id(p)][1]].clone()
                               for p in engine.module.parameters()]
            out["ds_averaged"] = [t.clone() for t in engine.optimizer.averaged_gradients[0]]
        engine.step()
    params = list(engine.module.parameters())
    out["full"] = [safe_get_full_fp32_param(p) for p in params]
    out["exp_avg"] = [safe_get_full_optimizer_state(p, "exp_avg") for p in params]
    stage = engine.stage
    out["pieces"] = [stage.groups[stage.place[id(p)][0]].views[stage.place[id(p)][1]].detach().clone() for p in params]
    out["state_pieces"] = [stage.optimizer.state[stage.groups[stage.place[id(p)][0]].views[stage.place[id(p)][1]]][
        "exp_avg"].clone() for p in params]
    with GatheredParameters(params):
        out["gathered"] = [p.detach().clone() for p in params]
    out["consolidated"] = engine._zero3_consolidated_16bit_state_dict()
    out["module_state"] = engine.stage.module_state_dict()
    # the accelerate-style loop over 2 ranks equals the plain loop
    plain = build(cfg(1, gas=2, micro=2))
    flagged = build(cfg(1, gas=2, micro=2))
    for i in range(4):
        micro_step(plain, i // 2, i % 2, rank, 2)
        plain.step()
        flagged.set_gradient_accumulation_boundary((i + 1) % 2 == 0)
        micro_step(flagged, i // 2, i % 2, rank, 2)
        if (i + 1) % 2 == 0:
            flagged.step()
    out["flag_equal"] = all(torch.equal(a, b) for a, b in zip(full_params(plain), full_params(flagged)))
    out["flag_steps"] = (plain.global_steps, flagged.global_steps)
    return out


@pytest.mark.multiprocess
def test_safe_get_full_values_at_stage3_over_two_processes():
    r0, r1 = run_distributed(_dist_stage3_job, 2)
    for i, (full0, full1) in enumerate(zip(r0["full"], r1["full"])):
        assert torch.equal(full0, full1)  # every rank gets the whole value
        n = full0.numel()
        # the full value is the ranks' master partitions, concatenated
        assert torch.equal(full0.reshape(-1), torch.cat([r0["pieces"][i], r1["pieces"][i]])[:n].float())
        # and the model's bf16 weight is its rounding
        assert torch.equal(full0.to(torch.bfloat16), r0["gathered"][i])
        assert torch.equal(r0["exp_avg"][i].reshape(-1), torch.cat([r0["state_pieces"][i], r1["state_pieces"][i]])[:n])
        assert torch.equal(r0["grads"][i].reshape(-1), torch.cat([r0["grad_pieces"][i], r1["grad_pieces"][i]])[:n])
        for r in (r0, r1):  # engine.optimizer.get_fp32_grad_partitions(): the same pieces, in fp32,
            part = r["ds_parts"][i]  # each ceil(n / 2) long (an odd size's last one zero-padded)
            assert part.dtype == torch.float32 and part.numel() == (n + 1) // 2
            assert torch.equal(part, r["grad_pieces"][i]) and torch.equal(r["ds_averaged"][i], part)
        if n % 2:
            assert r1["ds_parts"][i][-1] == 0
        assert torch.equal(r0["grads"][i], r1["grads"][i])
    assert r1["consolidated"] is None
    consolidated, module_state = r0["consolidated"], r0["module_state"]
    assert list(consolidated) == list(module_state)
    for k in module_state:
        assert torch.equal(consolidated[k], module_state[k]) and consolidated[k].dtype == torch.bfloat16
    assert r0["flag_equal"] and r1["flag_equal"] and r0["flag_steps"] == (2, 2)


# ============================================================================ ZeRO-3 leaf modules
class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 12)
        self.b = torch.nn.Linear(12, 12)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class WithExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(12, 12)
        self.experts = Experts()
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.out(self.experts(torch.tanh(self.inp(x))))


class Gathers:
    def __init__(self):
        self.ops = []

    @dsplug.hookimpl
    def dsplug_comm_op(self, op):
        self.ops.append(op)


def _gathers_in_forward(leaf: bool) -> int:
    from dsplug.utils import get_z3_leaf_modules, set_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter

    model = WithExperts()
    if leaf:
        marked = set_z3_leaf_modules(model, [Experts])
        assert marked == [model.experts] == get_z3_leaf_modules(model)
        assert z3_leaf_module(model.experts) and z3_leaf_parameter(model.experts.a.weight)
        assert not z3_leaf_parameter(model.inp.weight)
    engine = build(cfg(3, stage3_prefetch_bucket_size=0), model=model)
    listener = Gathers()
    comm.events.register(listener)
    try:
        with torch.no_grad():
            engine(batch(0, 0, 0, 4)[0])
    finally:
        comm.events.unregister(listener)
    engine.destroy()
    return listener.ops.count("all_gather")


def test_z3_leaf_module_is_gathered_as_one_unit():
    assert _gathers_in_forward(leaf=False) == 4  # inp, experts.a, experts.b, out
    assert _gathers_in_forward(leaf=True) == 3  # inp, experts (a and b together), out
    from dsplug.utils import set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    model = WithExperts()
    set_z3_leaf_modules(model, ["Experts"])
    assert z3_leaf_module(model.experts)
    unset_z3_leaf_modules(model, [Experts])
    assert not z3_leaf_module(model.experts) and not hasattr(model.experts.a.weight, "ds_z3_leaf_module")
    with pytest.raises(ValueError, match="Conv2d"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []


def test_z3_leaf_module_trains_like_without_it():
    from dsplug.utils import set_z3_leaf_modules

    results = []
    for leaf in (False, True):
        model = WithExperts()
        if leaf:
            set_z3_leaf_modules(model, [Experts])
        engine = build(cfg(3), model=model)
        losses = []
        for s in range(3):
            losses.append(micro_step(engine, s))
            engine.step()
        results.append((losses, full_params(engine)))
        engine.destroy()
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sparse", [False, True])
def test_sparse_tensor_module_names_are_deepspeeds_embedding_weights(sparse):
    """DeepSpeed's engine.sparse_tensor_module_names (its checkpoint tests compare it across a
    save and load): the embedding weights under sparse_gradients, else empty."""
    import dsplug

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 2),
                                torch.nn.EmbeddingBag(10, 4))
    engine = dsplug.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "sparse_gradients": sparse,
                                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    assert engine.sparse_gradients_enabled() is sparse
    assert engine.sparse_tensor_module_names == ({"0.weight", "3.weight"} if sparse else set())


@pytest.mark.parametrize("stage, file_name", [(0, "mp_rank_00_model_states.pt"),
                                              (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt")])
def test_optimizer_checkpoint_name_is_the_file_holding_this_ranks_optimizer_state(tmp_path, stage, file_name):
    """DeepSpeed's engine._get_optimizer_ckpt_name (its checkpoint tests spy on it): the file of the
    tag directory that a save wrote this rank's optimizer state into (the shared file where the
    state is replicated, the rank's file where the stage partitions it)."""
    import dsplug

    model = torch.nn.Linear(4, 2)
    engine = dsplug.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                    "zero_optimization": {"stage": stage},
                                                    "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})[0]
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t1")
    name = engine._get_optimizer_ckpt_name(str(tmp_path), "t1", 0)
    assert name == str(tmp_path / "t1" / file_name)
    exp_avg_sq = sorted(float(t.abs().sum()) for s in engine.optimizer.state.values() for k, t in s.items()
                        if k == "exp_avg_sq")
    from dsplug import checkpoint as ckpt

    saved = sorted(float(t.abs().sum()) for t in _tensors(ckpt.load_file(name))
                   if t.numel() in (2, 8, 10))  # weight, bias, or both flattened
    assert exp_avg_sq and all(any(abs(v - w) <= 1e-6 * max(1.0, v) for w in saved) for v in exp_avg_sq), \
        f"the optimizer's state is not in {file_name}"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
