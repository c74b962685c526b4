"""DeepSpeed's ZeRO memory estimators (plugins/zero/memory_estimators.py) against DeepSpeed 0.19.8's
own numbers and tables (tests/data/deepspeed/memory_estimates.json, made by
tests/data/deepspeed/make_memory_estimates.py in a separate DeepSpeed environment), and against the
example of DeepSpeed's documentation."""
from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

from dsplug.plugins.zero import memory_estimators as E

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "deepspeed"
FIXTURE = json.loads((DATA / "memory_estimates.json").read_text())
PRINTERS = {"z3_cold": E.estimate_zero3_model_states_mem_needs_all_cold,
            "z3_live": E.estimate_zero3_model_states_mem_needs_all_live,
            "z2_cold": E.estimate_zero2_model_states_mem_needs_all_cold,
            "z2_live": E.estimate_zero2_model_states_mem_needs_all_live}


def fixture_models():
    sys.path.insert(0, str(DATA))
    try:
        from make_memory_estimates import models
    finally:
        sys.path.remove(str(DATA))
    return models()


def test_the_fixture_comes_from_deepspeed_0_19_8():
    assert FIXTURE["deepspeed"] == "0.19.8" and len(FIXTURE["zero3"]) == 576 and len(FIXTURE["zero2"]) == 48


def test_zero3_estimates_equal_deepspeeds_over_the_grid():
    for kwargs, expected in FIXTURE["zero3"]:
        assert list(E.estimate_zero3_model_states_mem_needs(**kwargs)) == pytest.approx(expected, rel=0, abs=0), kwargs


def test_zero2_estimates_equal_deepspeeds_over_the_grid():
    for kwargs, expected in FIXTURE["zero2"]:
        assert list(E.estimate_zero2_model_states_mem_needs(**kwargs)) == pytest.approx(expected, rel=0, abs=0), kwargs


def test_parameter_counts_equal_deepspeeds():
    models = fixture_models()
    for name, expected in FIXTURE["model_to_params"].items():
        assert list(E.model_to_params(models[name])) == expected, name


@pytest.mark.parametrize("case", FIXTURE["printed"], ids=lambda c: f"{c['function']}-{sorted(c['kwargs'].items())}")
def test_printed_tables_are_deepspeeds(case, capsys):
    """Character for character, but for the device name: DeepSpeed's docs show ``cpu ``; DeepSpeed
    0.19.8 under Python 3.11 prints its enum's name there (``OffloadDeviceEnum.cpu``)."""
    kwargs = dict(case["kwargs"])
    if "model" in kwargs:
        kwargs["model"] = fixture_models()[kwargs["model"]]
    assert PRINTERS[case["function"]](**kwargs) is None
    assert capsys.readouterr().out == case["stdout"].replace("OffloadDeviceEnum.cpu", "cpu ")


def test_the_documented_t0_3b_example(capsys):
    """DeepSpeed's documentation (reference/004): bigscience/T0_3B, 2783M parameters, 65M in the
    largest layer, on 1 and 2 GPUs. The docs' figures come from the exact counts; these are rounded,
    so each is within 0.04 GB."""
    documented = {1: [(70.00, 0.25), (70.00, 0.25), (62.23, 5.43), (62.23, 5.43), (0.37, 46.91), (15.56, 46.91)],
                  2: [(70.00, 0.25), (70.00, 0.25), (62.23, 2.84), (62.23, 2.84), (0.74, 23.58), (31.11, 23.58)]}
    for gpus, rows in documented.items():
        E.estimate_zero3_model_states_mem_needs_all_cold(2783e6, 65e6, num_gpus_per_node=gpus, num_nodes=1)
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == f"HW: Setup with 1 node, {gpus} GPU{'s' if gpus > 1 else ''} per node."
        assert lines[2] == "SW: Model with 2783M total params, 65M largest layer params."
        printed = [(float(l.split("GB")[0]), float(l.split("|")[1].strip()[:-2])) for l in lines[4:]]
        assert printed == [pytest.approx(row, abs=0.04) for row in rows]
        assert lines[4].endswith("| offload_param=cpu , offload_optimizer=cpu , zero_init=1")
        assert lines[9].endswith("| offload_param=none, offload_optimizer=none, zero_init=0")


def test_the_plugin_declares_deepspeeds_import_paths():
    from dsplug.registry import get_registry

    paths = get_registry().api_paths()
    for path in ("dsplug.runtime.zero.stage3", "dsplug.runtime.zero.stage_1_and_2"):
        assert paths[path][0][0].target == E.__name__


def test_deepspeeds_import_paths_import():
    stage3 = importlib.import_module("dsplug.runtime.zero.stage3")
    stage12 = importlib.import_module("dsplug.runtime.zero.stage_1_and_2")
    assert stage3.estimate_zero3_model_states_mem_needs_all_live is E.estimate_zero3_model_states_mem_needs_all_live
    assert stage3.estimate_zero3_model_states_mem_needs_all_cold is E.estimate_zero3_model_states_mem_needs_all_cold
    assert stage12.estimate_zero2_model_states_mem_needs_all_live is E.estimate_zero2_model_states_mem_needs_all_live
    assert stage12.estimate_zero2_model_states_mem_needs_all_cold is E.estimate_zero2_model_states_mem_needs_all_cold
