"""The test harness's timeouts scale with the machine (DSPLUG_TEST_TIMEOUT_SCALE, the load)."""
from __future__ import annotations

import os
import time

import pytest

from tests import conftest
from tests.conftest import TIMEOUT_SCALE_ENV, Deadline, scaled
from tests.dist_harness import run_distributed


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


@pytest.mark.multiprocess
def test_a_rank_slower_than_the_quiet_timeout_passes_on_a_slow_machine(monkeypatch):
    """A rank that takes 4 s (and its start-up) with a 2 s budget: too slow for a quiet machine,
    fine on one 30 times slower."""
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "30")
    assert run_distributed(_sleep, 1, 4.0, timeout=2) == [4.0]


@pytest.mark.multiprocess
def test_a_hung_rank_still_times_out(monkeypatch):
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "1")
    monkeypatch.setattr(conftest, "load_factor", lambda: 1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of _sleep did not finish within 3 s of a quiet machine"):
        run_distributed(_sleep, 1, 600, timeout=3)
    assert time.monotonic() - started < 120


def test_a_deadline_lasts_longer_while_the_load_is_high(monkeypatch):
    clock = {"now": 1000.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["now"])
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "1")
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 40.0, 40.0))  # load 20 per core on 2 cores
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    deadline = Deadline(10)
    clock["now"] += 150  # 150 s at load factor 20: 7.5 s of a quiet machine
    assert not deadline.expired()
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))  # quiet again: seconds count fully
    clock["now"] += 3
    assert deadline.expired()
    assert scaled(10) == 10


def test_the_scale_variable_is_checked(monkeypatch):
    for bad in ("abc", "0.5", "-2"):
        monkeypatch.setenv(TIMEOUT_SCALE_ENV, bad)
        with pytest.raises(pytest.UsageError, match=TIMEOUT_SCALE_ENV):
            conftest.static_timeout_scale()
    monkeypatch.delenv(TIMEOUT_SCALE_ENV)
    assert conftest.static_timeout_scale() >= 1  # the calibration
