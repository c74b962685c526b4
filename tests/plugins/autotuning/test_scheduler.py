"""``deepspeed.autotuning.scheduler.ResourceManager``: hosts, slots and arg_mappings."""
from __future__ import annotations

import importlib

import pytest

from dsplug.plugins.autotuning.scheduler import ResourceManager
from dsplug.plugins.autotuning.space import AutotuningError


def test_hosts_slots_and_directories():
    rm = ResourceManager(args=None, hosts="worker-0, worker-1,", num_gpus_per_node=4, results_dir="res",
                         exps_dir="exps", arg_mappings=None)
    assert [(n.host, n.max_slots, n.idle_slots) for n in rm.nodes] == \
        [("worker-0", 4, [0, 1, 2, 3]), ("worker-1", 4, [0, 1, 2, 3])]
    assert (rm.results_dir, rm.exps_dir, rm.num_gpus_per_node, rm.arg_mappings) == ("res", "exps", 4, {})
    assert [n.host for n in ResourceManager(None, ["a", " b "], 1, None, None, {}).nodes] == ["a", "b"]


def test_arg_mappings_are_stripped_and_checked():
    rm = ResourceManager(None, "h", 1, None, None, {" train_batch_size ": " -tbs ",
                                                    "gradient_accumulation_steps": "--gas"})
    assert rm.arg_mappings == {"train_batch_size": "-tbs", "gradient_accumulation_steps": "--gas"}
    with pytest.raises(AutotuningError, match="not a command-line flag"):
        ResourceManager(None, "h", 1, None, None, {"train_batch_size": "tbs"})
    with pytest.raises(AutotuningError, match="no host"):
        ResourceManager(None, " , ", 1, None, None, None)
    with pytest.raises(AutotuningError, match="num_gpus_per_node"):
        ResourceManager(None, "h", 0, None, None, None)


def test_scheduling_experiment_files_is_refused_clearly():
    rm = ResourceManager(None, "h", 1, None, None, None)
    with pytest.raises(NotImplementedError, match="Autotuner.tune"):
        rm.schedule_experiments(["exp.json"])
    with pytest.raises(NotImplementedError, match="Autotuner.tune"):
        rm.run()


def test_served_at_deepspeeds_paths():
    assert importlib.import_module("dsplug.autotuning.scheduler").ResourceManager is ResourceManager
    from dsplug.plugins.autotuning.autotuner import Autotuner

    assert importlib.import_module("dsplug.autotuning.autotuner").Autotuner is Autotuner
