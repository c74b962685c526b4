"""The flops profiler's strings against DeepSpeed 0.19.8's (tests/data/deepspeed/flops_strings.json,
made by tests/data/deepspeed/make_flops_strings.py in a separate DeepSpeed environment)."""
from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

from dsplug.plugins.profilers.flops_profiler import formatting as F
from dsplug.profiling.flops_profiler import get_model_profile

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "deepspeed"
FIXTURE = json.loads((DATA / "flops_strings.json").read_text())
EXPONENT = re.compile(r"\de[+-]\d")


def test_the_fixture_comes_from_deepspeed_0_19_8():
    assert FIXTURE["deepspeed"] == "0.19.8" and len(FIXTURE["strings"]) == 2736


def test_every_string_is_deepspeeds_but_its_exponent_forms():
    """Equal to DeepSpeed's text, thousands as ``K`` included; where DeepSpeed writes an exponent
    (a number forced into too small a unit) or ``-0``, dsplug writes the plain number (documented in
    formatting.py), checked to be the same value. (A negative number, which no count is, DeepSpeed
    writes in ``u``: there only the absence of an exponent is checked.)"""
    exact = 0
    for name, value, units, precision, theirs in FIXTURE["strings"]:
        ours = getattr(F, name)(value, units=units, precision=precision)
        if EXPONENT.search(theirs) or theirs.startswith("-0 ") or theirs == "-0":
            assert not EXPONENT.search(ours), (name, value, units, ours)
            if value < 0:
                continue
            number, unit = theirs.split(" ", 1) if " " in theirs else (theirs, "")
            assert ours.split(" ", 1)[1:] == [unit] or (not unit and " " not in ours), (name, value, units, ours)
            assert float(ours.split(" ")[0]) == pytest.approx(float(number), rel=1e-5, abs=0.5), (name, value, units)
            continue
        assert ours == theirs, (name, value, units, precision)
        exact += 1
    assert exact > 2000  # of 2736; the rest are exponent forms


def test_the_issues_strings():
    assert F.number_to_string(995970) == "995.97 K" and F.macs_to_string(488700) == "488.7 KMACs"


def test_model_profile_strings_are_deepspeeds():
    sys.path.insert(0, str(DATA))
    try:
        from make_flops_strings import INPUT_SHAPE, model
    finally:
        sys.path.remove(str(DATA))
    flops, macs, params = get_model_profile(model(), input_shape=INPUT_SHAPE, print_profile=False, as_string=True)
    assert {"flops": flops, "macs": macs, "params": params} == FIXTURE["model_profile"]
