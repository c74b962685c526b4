"""DeepSpeed's recorder API (``deepspeed.utils.comms_logging.CommsLogger``) over the comms logger.

Expected values are computed by hand from the nccl-tests bandwidth definitions (bytes * 8 / seconds
/ 1e9, times 2(n-1)/n for an all-reduce) and the trimmed mean's definition, not from the plugin.
"""
from __future__ import annotations

import importlib

import pytest

from dsplug.plugins.comms_logger.comms_logging import CommsLogger
from dsplug.plugins.comms_logger.logger import comm_hooks


def test_defaults_and_profiling_switches():
    log = CommsLogger()
    assert (log.enabled, log.verbose, log.debug, log.prof_all, log.prof_ops, log.comms_dict) == \
        (False, False, False, True, [], {})
    log.stop_profiling_comms()
    assert log.prof_all is False
    log.start_profiling_comms()
    assert log.prof_all is True
    log.start_profiling_op(["all_reduce", "broadcast"])
    log.start_profiling_op(["all_reduce"])
    assert sorted(log.prof_ops) == ["all_reduce", "broadcast"]
    log.stop_profiling_op(["all_reduce"])
    assert log.prof_ops == ["broadcast"]


def test_append_keeps_parallel_lists_and_bandwidths():
    log = CommsLogger()
    # 1 MB all-reduce over 4 ranks in 2 ms: algbw = 1e6 * 8 / 0.002 / 1e9 = 4 Gbps; busbw = 4 * 2 * 3/4 = 6
    log.append("all_reduce", "all_reduce", 2.0, 1_000_000, world_size=4)
    log.append("all_reduce", "all_reduce", 4.0, 1_000_000, world_size=4)
    log.append("broadcast", "broadcast", 1.0, 500, world_size=4)
    count, lats, algbws, busbws = log.comms_dict["all_reduce"][1_000_000]
    assert count == 2 and lats == [2.0, 4.0]
    assert algbws == pytest.approx([4.0, 2.0]) and busbws == pytest.approx([6.0, 3.0])
    assert log.get_operation_names() == ["all_reduce", "broadcast"]
    assert log.get_total_count() == 3
    assert log.get_total_latency() == pytest.approx(7.0)
    assert log.get_total_msg_size() == 2_000_500
    assert log.has_data()
    log.reset_data()
    assert not log.has_data() and log.get_total_count() == 0


def test_summary_is_trimmed_mean_and_does_not_reorder_records():
    log = CommsLogger()
    lats = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 3.0, 2.0, 4.0, 1.0]  # 10 values: trim one from each end
    log.comms_dict = {"all_gather": {64: [10, list(lats), [1.0 / x for x in lats], [2.0 / x for x in lats]]}}
    summary = log.get_operation_summary("all_gather")[64]
    kept = sorted(lats)[1:-1]
    assert summary["count"] == 10
    assert summary["total_latency_ms"] == pytest.approx(sum(lats))
    assert summary["avg_latency_ms"] == pytest.approx(sum(kept) / 8)
    assert summary["msg_size_bytes"] == 64 and summary["msg_size_str"] == "64 B"
    assert log.comms_dict["all_gather"][64][1] == lats
    assert log.get_operation_summary("reduce") is None
    assert log.log_all(print_log=False, return_dict=True) == {"all_gather": log.get_operation_summary("all_gather")}
    with pytest.raises(NotImplementedError, match="show_straggler"):
        log.log_all(show_straggler=True)


def test_configure_from_section_and_gated_recording_through_comm_hooks():
    log = CommsLogger()
    hooks = comm_hooks(log)
    hooks.dsplug_comm_op(op="all_reduce", nbytes=8, latency_s=0.001, world_size=2, async_op=False)
    assert log.comms_dict == {}  # not enabled
    log.configure({"enabled": True, "prof_all": False, "prof_ops": ["broadcast"], "debug": True})
    assert (log.enabled, log.prof_all, log.prof_ops, log.debug) == (True, False, ["broadcast"], True)
    log.record("all_reduce", 8, 0.001, 2)
    log.record("broadcast", 8, 0.001, 2, caller="step")
    assert list(log.comms_dict) == ["broadcast | [Caller Func: step]"]
    assert log.comms_dict["broadcast | [Caller Func: step]"][8][1] == [pytest.approx(1.0)]


def test_served_at_deepspeeds_path():
    module = importlib.import_module("dsplug.utils.comms_logging")
    assert module.CommsLogger is CommsLogger
