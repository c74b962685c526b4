"""``deepspeed.autotuning.utils``: key lookup and replacement at any depth of a config dict."""
from __future__ import annotations

import importlib

from dsplug.plugins.autotuning.utils import get_val_by_key, set_val_by_key


def test_get_finds_a_key_at_any_depth_in_any_subdict():
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert get_val_by_key(config, "train_batch_size") == 8
    assert get_val_by_key(config, "lr") == 0.1
    assert get_val_by_key(config, "device") == "cpu"  # in the second top-level subdict
    assert get_val_by_key(config, "stage") == 3
    assert get_val_by_key(config, "absent") is None
    # the first match depth-first, in the dicts' order
    assert get_val_by_key({"a": {"k": 1}, "b": {"k": 2}}, "k") == 1


def test_set_replaces_every_occurrence_and_adds_nothing():
    config = {"a": {"device": "cpu", "b": {"device": "cpu"}}, "c": {"x": 1}}
    set_val_by_key(config, "device", "nvme")
    assert config == {"a": {"device": "nvme", "b": {"device": "nvme"}}, "c": {"x": 1}}
    set_val_by_key(config, "missing", 5)
    assert config == {"a": {"device": "nvme", "b": {"device": "nvme"}}, "c": {"x": 1}}
    assert get_val_by_key(config, "device") == "nvme"


def test_served_at_deepspeeds_path():
    module = importlib.import_module("dsplug.autotuning.utils")
    assert (module.get_val_by_key, module.set_val_by_key) == (get_val_by_key, set_val_by_key)
