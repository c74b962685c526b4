"""DeepSpeed names of the ZeRO plugins: zero_to_fp32.get_optim_files, MultipleAllGatherHandles,
partitioned_param_data_shape, ZeRORuntimeException, the wrapper-optimizer names, and the
``zero_optimization`` forms DeepSpeed accepts (cpu_offload_param, offload_* null,
pipeline_loading_checkpoint, offload_optimizer.pipeline)."""
from __future__ import annotations

import os
import warnings

import pytest

from dsplug.config import ConfigError


def test_get_optim_files_orders_by_the_numbers_in_the_names(tmp_path):
    from dsplug.utils.zero_to_fp32 import get_optim_files

    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (10, 2, 0, 1, 11)]
    for name in names:
        (tmp_path / name).write_text("x")
    (tmp_path / "mp_rank_00_model_states.pt").write_text("x")
    got = [os.path.basename(p) for p in get_optim_files(tmp_path)]
    assert got == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1, 2, 10, 11)]
    with pytest.raises(FileNotFoundError, match="no \\*_optim_states.pt"):
        get_optim_files(tmp_path / "..")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        get_optim_files(tmp_path / "missing")


def test_multiple_all_gather_handles_wait_each_with_the_keywords():
    from dsplug.runtime.zero.partition_parameters import MultipleAllGatherHandles

    calls = []

    class Handle:
        def __init__(self, name):
            self.name = name

        def wait(self, **kwargs):
            calls.append((self.name, kwargs))

    group = MultipleAllGatherHandles([Handle("a"), Handle("b")])
    group.wait(handle_dependency=False)
    group.wait()
    assert calls == [("a", {"handle_dependency": False}), ("b", {"handle_dependency": False}), ("a", {}), ("b", {})]
    assert len(group) == 2


def test_partitioned_param_data_shape_is_the_placeholder_shape():
    import torch

    from dsplug.runtime.zero.partition_parameters import partitioned_param_data_shape

    # what a partitioned parameter's .data is while not gathered (ParamPartitioner's placeholder)
    assert torch.empty(0).shape == torch.Size(partitioned_param_data_shape)


def test_zero_runtime_exception_is_a_value_error_raised_for_a_foreign_cpu_optimizer():
    import torch

    import dsplug
    from dsplug.runtime.zero.utils import ZeRORuntimeException

    assert issubclass(ZeRORuntimeException, ValueError)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        dsplug.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
            "train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def test_zero_wrapper_optimizer_names_refuse_construction():
    from dsplug.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, estimate_zero3_model_states_mem_needs_all_cold
    from dsplug.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from dsplug.unavailable import NotAvailableInDsplug

    assert callable(estimate_zero3_model_states_mem_needs_all_cold)  # the real names at the path stay
    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert not isinstance(object(), cls)
        with pytest.raises(NotAvailableInDsplug, match="engine.stage"):
            cls(None)


def test_zero_config_accepts_deepspeeds_legacy_and_null_forms():
    from dsplug.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                            DeepSpeedZeroOffloadParamConfig)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        conf = DeepSpeedZeroConfig(cpu_offload_param=True)
    assert isinstance(conf.offload_param, DeepSpeedZeroOffloadParamConfig) and conf.offload_param.device == "cpu"
    conf = DeepSpeedZeroConfig(offload_param=None, offload_optimizer=None)
    assert conf.offload_param is None and conf.offload_optimizer is None
    assert DeepSpeedZeroConfig(stage=2).pipeline_loading_checkpoint is False
    with pytest.raises(ConfigError, match="keep only offload_param"):
        DeepSpeedZeroConfig(cpu_offload_param=True, offload_param={"device": "cpu"})
    for read, write in ((False, False), (True, False), (False, True), (True, True)):
        off = DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=read, pipeline_write=write)
        assert off.pipeline is (read or write)


def test_cpu_offload_param_in_a_config_warns_and_offloads():
    from dsplug.config import DsplugConfig

    with pytest.warns(Warning, match="cpu_offload_param.*deprecated"):
        config = DsplugConfig({"train_batch_size": 1, "zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert config.to_dict()["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_elastic_checkpoint_logs_deepspeeds_deprecation_on_the_logger(monkeypatch):
    """DeepSpeed's config model logs that ZeRO-3 elastic checkpointing is deprecated (its
    test_elastic_checkpoint_is_deprecated_for_zero3 patches ``deepspeed.utils.logger.warning``);
    a whole config warns once, as a warning, not again on the logger when its section is read."""
    from dsplug.config import DsplugConfig
    from dsplug.runtime.config import DeepSpeedConfig
    from dsplug.runtime.zero.config import DeepSpeedZeroConfig
    from dsplug.utils import logger

    logged = []
    monkeypatch.setattr(logger, "warning", lambda message, *args, **kwargs: logged.append(str(message)))
    DeepSpeedZeroConfig(stage=3)
    assert logged == []
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert len(logged) == 1 and "elastic checkpointing is deprecated" in logged[0].lower()
    assert logged[0].startswith("zero_optimization.elastic_checkpoint")

    logged.clear()
    raw = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "elastic_checkpoint": True}}
    with pytest.warns(Warning, match="elastic checkpointing is deprecated"):
        DsplugConfig(dict(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert DeepSpeedConfig(dict(raw)).zero_config.elastic_checkpoint is True
    assert logged == []
