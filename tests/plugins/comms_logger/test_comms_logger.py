"""The comms logger: config section, bandwidth arithmetic, and what a real 2-process run logs.

The expected collectives of the training run are derived from the model's parameter shapes and
ZeRO stage 0's documented bucketing (gradients grouped in backward order, reverse registration
order, into buckets of at most ``reduce_bucket_size`` elements; one all-reduce per bucket per
optimizer step), not from the logger itself.
"""
from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest
import torch

from dsplug.config import ConfigError, DsplugConfig
from dsplug.config.schema import describe, parse
from dsplug.plugins.comms_logger.config import DSPLUG_OPS, CommsLoggerConfig, selected_ops
from dsplug.plugins.comms_logger.logger import CommsRecorder, bandwidths, format_size
from dsplug.plugins.comms_logger.observer import CommsLoggerObserver, build_observer

from tests.dist_harness import run_distributed
from tests.engine_common import batch, loss_fn, make_model

BUCKET = 500  # zero_optimization.reduce_bucket_size of the training run: several buckets
STEPS, GAS, MICRO = 3, 2, 4


# --------------------------------------------------------------------------- config section
def test_schema_has_deepspeeds_keys_and_defaults():
    defaults = parse(CommsLoggerConfig, {}, "comms_logger")
    assert {row[0]: row[2] for row in describe(CommsLoggerConfig)} == {
        "enabled": "False", "verbose": "False", "prof_all": "True", "debug": "False", "prof_ops": "[]"}
    assert (defaults.enabled, defaults.verbose, defaults.prof_all, defaults.debug, defaults.prof_ops) == \
        (False, False, True, False, [])
    docs_example = {"enabled": True, "verbose": False, "prof_all": False, "debug": False,
                    "prof_ops": ["all_reduce", "all_gather"]}
    assert selected_ops(parse(CommsLoggerConfig, docs_example, "comms_logger")) == {"all_reduce", "all_gather"}


def test_schema_errors_name_the_key_and_what_is_valid():
    config = {"train_batch_size": 2, "comms_logger": {"enabled": "yes", "verbos": True,
                                                       "prof_ops": ["all_reduse", "all_gather"], "debug": 2}}
    with pytest.raises(ConfigError) as info:
        DsplugConfig(config, world_size=1)
    issues = {issue.path: issue.message for issue in info.value.issues}
    assert set(issues) == {"comms_logger.enabled", "comms_logger.verbos", "comms_logger.prof_ops",
                           "comms_logger.debug"}
    assert "expected a boolean" in issues["comms_logger.enabled"]
    assert "did you mean 'comms_logger.verbose'" in issues["comms_logger.verbos"]
    assert "'all_reduse' (did you mean 'all_reduce'?)" in issues["comms_logger.prof_ops"]
    assert "all_gather_into_tensor" in issues["comms_logger.prof_ops"]  # lists the valid names
    with pytest.raises(ConfigError, match=r"comms_logger.prof_ops: 'all_reduce' is not valid: expected a list"):
        DsplugConfig({"train_batch_size": 2, "comms_logger": {"prof_ops": "all_reduce"}}, world_size=1)


def test_deepspeed_op_names_select_dsplug_ops():
    config = parse(CommsLoggerConfig, {"prof_all": False, "prof_ops": [
        "all_gather_into_tensor", "reduce_scatter_tensor", "inference_all_reduce", "all_to_all_single"]}, "c")
    assert selected_ops(config) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all_single"}
    assert selected_ops(parse(CommsLoggerConfig, {"prof_ops": ["barrier"]}, "c")) is None  # prof_all wins


# --------------------------------------------------------------------------- arithmetic
def test_format_size():
    assert [format_size(n) for n in (0, 4, 1023, 3948, 8 * 2 ** 20, 3 * 2 ** 30)] == \
        ["0 B", "4 B", "1023 B", "3.86 KB", "8.00 MB", "3.00 GB"]


@pytest.mark.parametrize("op, factor", [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4), ("reduce_scatter", 3 / 4),
                                        ("broadcast", 1.0), ("reduce", 1.0), ("barrier", 1.0)])
def test_rows_average_counts_and_bandwidths(op, factor):
    log = CommsRecorder(rank=0)
    log.record(op, 10 ** 6, 0.002, 4)  # 8e6 bits in 2 ms = 4 Gbps
    log.record(op, 10 ** 6, 0.004, 4, async_op=True)  # 2 Gbps
    log.record(op, 10, 0.001, 4)
    big, = [r for r in log.rows() if r["nbytes"] == 10 ** 6]
    assert big["count"] == 2 and big["async_count"] == 1
    assert big["total_latency_ms"] == pytest.approx(6.0) and big["avg_latency_ms"] == pytest.approx(3.0)
    assert big["algbw_gbps"] == pytest.approx(3.0)  # mean of the per-op figures, as DeepSpeed reports
    assert big["busbw_gbps"] == pytest.approx(3.0 * factor)
    assert bandwidths(op, 10 ** 6, 0.0, 4) == (0.0, 0.0)
    text = log.summary_text()
    assert re.search(rf"^{op}\n +10 B +1 +1\.000 +1\.000 .*\n +976\.56 KB +2 +6\.000 +3\.000 +3\.00 ", text, re.M)
    assert f"note: {op} ran asynchronously" in text


def test_prof_ops_filter_and_debug_labels():
    log = CommsRecorder(ops={"broadcast"}, debug=True)
    log.record("all_reduce", 8, 0.001, 2, caller="f")
    log.record("broadcast", 8, 0.001, 2, caller="f")
    log.record("broadcast", 8, 0.001, 2, caller="g")
    assert [(r["label"], r["count"]) for r in log.rows()] == [
        ("broadcast | [Caller Func: f]", 1), ("broadcast | [Caller Func: g]", 1)]
    assert "(no communication ops were logged)" in CommsRecorder().summary_text()


# --------------------------------------------------------------------------- the observer
class _FakeComm:
    def __init__(self):
        from dsplug.comm.hooks import CommEvents

        self.events = CommEvents()

    @property
    def logs(self):
        return [hooks.log for hooks in self.events.get_plugins()]


class _Context:
    def __init__(self):
        self.rank, self.comm = 0, _FakeComm()


def test_factory_registers_the_comm_hooks_and_engine_close_removes_them():
    context = _Context()
    assert build_observer({"verbose": True}, context) is None  # enabled defaults to false
    assert build_observer(None, context) is None and context.comm.logs == []
    observer = build_observer({"enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter_tensor"]}, context)
    assert isinstance(observer, CommsLoggerObserver)
    log, = context.comm.logs
    assert log.ops == {"reduce_scatter"} and not log.verbose and not log.debug
    assert context.comm.events.watching and not context.comm.events.wants_caller  # no caller look-up
    observer.dsplug_engine_closed(engine=None)
    assert context.comm.logs == [] and not context.comm.events.watching


def test_debug_takes_the_caller_and_records_what_the_hook_reports():
    context = _Context()
    observer = build_observer({"enabled": True, "debug": True}, context)
    assert context.comm.events.wants_caller
    context.comm.events.hook.dsplug_comm_op(op="broadcast", nbytes=8, latency_s=0.001, world_size=2, async_op=True,
                                            caller="f")
    assert [(r["label"], r["async_count"]) for r in observer.log.rows()] == [("broadcast | [Caller Func: f]", 1)]
    assert context.comm.events.hook.dsplug_comm_summary(show_straggler=False) == [observer.log.summary_text()]


def test_factory_warns_about_prof_ops_that_cannot_take_effect(caplog):
    logger = logging.getLogger("dsplug")
    logger.propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="dsplug"):
            build_observer({"enabled": True, "prof_ops": ["all_reduce"]}, _Context())
            build_observer({"enabled": True, "prof_all": False, "prof_ops": ["gather"]}, _Context())
    finally:
        logger.propagate = False
    assert "prof_all is true, so every op is logged and prof_ops ['all_reduce'] has no effect" in caplog.text
    assert "never issues gather" in caplog.text
    assert "names no op that dsplug issues, so nothing will be logged" in caplog.text


# --------------------------------------------------------------------------- a real 2-process run
def _engine(comms_logger: dict):
    import dsplug

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
              "zero_optimization": {"stage": 0, "reduce_bucket_size": BUCKET},
              "comms_logger": {"enabled": True, **comms_logger}}
    engine, _, _, _ = dsplug.initialize(model=make_model(), optimizer=lambda g: torch.optim.SGD(g, lr=0.1),
                                        config=config)
    observer, = [o for o in engine.observers if isinstance(o, CommsLoggerObserver)]
    return engine, observer.log


def _train(engine, steps):
    from dsplug import comm

    for step in range(steps):
        for m in range(GAS):
            x, y = batch(step, m, comm.get_rank(), MICRO)
            engine.backward(loss_fn(engine(x), y))
            engine.step()


def _every_collective():
    """One call of each comm-layer collective, float32 tensors (sizes in the test below)."""
    from dsplug import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    t = torch.ones(10)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((10,), float(world)))
    comm.broadcast(torch.ones(7), src=0)
    comm.all_gather_into_tensor(torch.empty(5 * world), torch.ones(5))
    comm.all_gather([torch.empty(3) for _ in range(world)], torch.ones(3))
    comm.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world))
    comm.reduce(torch.ones(6), dst=0)
    comm.barrier()
    comm.all_reduce(torch.ones(9) * rank, async_op=True).wait()


def _filtered_collectives():
    from dsplug import comm

    comm.broadcast(torch.ones(7), src=0)
    comm.all_gather_into_tensor(torch.empty(5 * comm.get_world_size()), torch.ones(5))
    comm.reduce(torch.ones(6), dst=0)


def _logged_run():
    from dsplug import comm

    out = {}
    engine, listener = _engine({"verbose": True})
    listener.reset()  # start from the training: what initialize issued is not under test here
    verbose = io.StringIO()
    with contextlib.redirect_stdout(verbose):
        _train(engine, STEPS)
        _every_collective()
    out["verbose"] = verbose.getvalue()
    out["rows"] = listener.rows()
    summary = io.StringIO()
    with contextlib.redirect_stdout(summary):
        comm.log_summary()
        comm.log_summary(show_straggler=True)
    out["printed"] = summary.getvalue()
    out["summary"] = listener.summary_text()
    engine.destroy()
    out["listeners_after_close"] = len(comm.events.hook.dsplug_comm_op.get_hookimpls())

    engine, listener = _engine({"prof_all": False, "prof_ops": ["all_reduce", "all_gather_into_tensor"],
                                "debug": True})
    listener.reset()
    _train(engine, 1)
    _filtered_collectives()
    out["filtered_rows"] = listener.rows()
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def logged():
    return run_distributed(_logged_run, 2)


def _bucket_bytes():
    """Stage 0's buckets for this model: reverse registration order, at most BUCKET elements."""
    buckets, current = [], 0
    for p in reversed(list(make_model().parameters())):
        if current and current + p.numel() > BUCKET:
            buckets.append(current)
            current = 0
        current += p.numel()
    buckets.append(current)
    return [4 * n for n in buckets]


def test_bucket_reference_has_several_buckets():
    assert sum(_bucket_bytes()) == 4 * sum(p.numel() for p in make_model().parameters())
    assert len(_bucket_bytes()) == 3


EVERY_COLLECTIVE = {("all_reduce", 40): 1, ("broadcast", 28): 1, ("all_gather", 40): 1, ("all_gather", 24): 1,
                    ("reduce_scatter", 32): 1, ("reduce", 24): 1, ("barrier", 0): 1, ("all_reduce", 36): 1}


@pytest.mark.multiprocess
def test_counts_and_sizes_match_what_the_run_issued(logged):
    want = {("all_reduce", b): STEPS for b in _bucket_bytes()}  # one all-reduce per bucket per step
    want.update(EVERY_COLLECTIVE)
    for rank in logged:
        got = {(r["op"], r["nbytes"]): r["count"] for r in rank["rows"]}
        assert got == want
        asynchronous = {(r["op"], r["nbytes"]): r["async_count"] for r in rank["rows"] if r["async_count"]}
        assert asynchronous == {**{("all_reduce", b): STEPS for b in _bucket_bytes()}, ("all_reduce", 36): 1}
        assert {r["op"] for r in rank["rows"]} == set(DSPLUG_OPS)
        assert rank["listeners_after_close"] == 0


@pytest.mark.multiprocess
def test_verbose_prints_every_op_with_rank_size_latency_and_bandwidth(logged):
    line = re.compile(r"^\[rank (\d)\] comm op: (\w+)( \(async\))? \| time \(ms\): ([\d.]+) \| msg size: (.+?) \| "
                      r"algbw \(Gbps\): ([\d.e+-]+) \| busbw \(Gbps\): ([\d.e+-]+)$")
    for rank, out in enumerate(logged):
        lines = out["verbose"].splitlines()
        matches = [line.match(text) for text in lines]
        assert all(matches), [t for t, m in zip(lines, matches) if not m]
        want = sorted([("all_reduce", format_size(b)) for b in _bucket_bytes()] * STEPS +
                      [(op, format_size(n)) for (op, n) in EVERY_COLLECTIVE])
        assert sorted((m.group(2), m.group(5)) for m in matches) == want
        assert {int(m.group(1)) for m in matches} == {rank}
        for m in matches:
            algbw, busbw = float(m.group(6)), float(m.group(7))
            factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}.get(m.group(2), 1.0)  # n = 2
            assert busbw == pytest.approx(algbw * factor, rel=0.02)  # both printed to 3 digits
        assert sum(1 for m in matches if m.group(3)) == STEPS * len(_bucket_bytes()) + 1


@pytest.mark.multiprocess
def test_log_summary_table(logged):
    rank0, rank1 = logged
    assert rank1["printed"] == ""  # only rank 0 prints, like DeepSpeed
    assert rank0["printed"].startswith(rank0["summary"])
    text = rank0["summary"]
    assert "Comm. Op" in text and "tput_avg (Gbps)" in text and "busbw_avg (Gbps)" in text
    table = {}
    op = None
    for line in text.splitlines()[2:]:
        if line.startswith("note:"):
            break
        if not line.startswith(" "):
            op = line
            continue
        size, unit, count = line.split()[:3]
        table[(op, f"{size} {unit}")] = int(count)
    want = {("all_reduce", format_size(b)): STEPS for b in _bucket_bytes()}
    want.update({(op, format_size(n)): c for (op, n), c in EVERY_COLLECTIVE.items()})
    assert table == want
    assert "note: all_reduce ran asynchronously" in text


@pytest.mark.multiprocess
def test_straggler_summary_splits_latency_into_fastest_rank_and_excess(logged):
    rank0 = logged[0]
    text = rank0["printed"][len(rank0["summary"]):]
    assert "straggler summary (rank 0, 2 ranks)" in text and "Total straggler(ms)" in text
    totals = {(r["op"], format_size(r["nbytes"])): r for r in rank0["rows"]}
    op, seen = None, 0
    for line in text.splitlines():
        if line and not line.startswith(" ") and line in DSPLUG_OPS:
            op = line
        elif line.startswith(" ") and op:
            size, unit, count, comm_ms, straggler_ms = line.split()[:5]
            row = totals[(op, f"{size} {unit}")]
            assert int(count) == row["count"] and float(straggler_ms) >= 0
            # this rank's time = the fastest rank's time + this rank's excess
            assert float(comm_ms) + float(straggler_ms) == pytest.approx(row["total_latency_ms"], abs=2e-3)
            seen += 1
    assert seen == len(rank0["rows"])


@pytest.mark.multiprocess
def test_prof_ops_and_debug_callers_in_a_run(logged):
    for rank in logged:
        got = {(r["op"], r["caller"], r["nbytes"]): r["count"] for r in rank["filtered_rows"]}
        want = {("all_reduce", "GradientBuckets._launch", b): 1 for b in _bucket_bytes()}  # async: launch site
        want[("all_gather", "_filtered_collectives", 40)] = 1
        assert got == want


# --------------------------------------------------------------------------- one rank, against DeepSpeed
def _deepspeed_comms_log():
    """tests/data/deepspeed/comms_log.json (DeepSpeed 0.19.8's records at 1 rank) and its maker module."""
    import json
    import pathlib
    import sys

    data = pathlib.Path(__file__).resolve().parents[2] / "data" / "deepspeed"
    sys.path.insert(0, str(data))
    try:
        import make_comms_log
    finally:
        sys.path.remove(str(data))
    return json.loads((data / "comms_log.json").read_text()), make_comms_log


DS_LOG, DS_MAKER = _deepspeed_comms_log()


def _one_rank_records(name: str):
    """dsplug at 1 rank on the maker's script: {op: {size: count}} after initialize and after training."""
    import dsplug

    stage, bf16 = DS_MAKER.CASES[name]
    model = DS_MAKER.make_model()
    engine, *_ = dsplug.initialize(model=model, model_parameters=model.parameters(),
                                   config=DS_MAKER.config(stage, bf16))
    log, = [o for o in engine.observers if isinstance(o, CommsLoggerObserver)]

    def records():
        out = {}
        for row in log.log.rows():
            out.setdefault(row["op"], {})[str(row["nbytes"])] = row["count"]
        return out

    after_init = records()
    DS_MAKER.train(engine, torch.bfloat16 if bf16 else torch.float32)
    after_training = records()
    engine.destroy()
    return after_init, after_training


def test_the_comms_fixture_comes_from_deepspeed_0_19_8():
    assert DS_LOG["deepspeed"] == "0.19.8" and set(DS_LOG["cases"]) == set(DS_MAKER.CASES)
    assert (DS_LOG["micro"], DS_LOG["gas"], DS_LOG["steps"]) == (DS_MAKER.MICRO, DS_MAKER.GAS, DS_MAKER.STEPS)


@pytest.mark.parametrize("name", sorted(DS_MAKER.CASES))
def test_one_rank_logs_deepspeeds_initial_broadcast(name):
    """At one rank DeepSpeed still broadcasts every parameter from rank 0 at initialize (its
    ``_broadcast_model``), and its comms logger lists those broadcasts; dsplug logs the same ops,
    counts and message sizes (16-bit sizes under bf16: the model is cast first). Until then
    dsplug's log at one rank was empty."""
    after_init, after_training = _one_rank_records(name)
    want = DS_LOG["cases"][name]["after_initialize"]["broadcast | [Caller Func: _broadcast_model]"]
    assert after_init["broadcast"] == want
    assert after_training["broadcast"] == want  # nothing else broadcast while training


@pytest.mark.parametrize("name, ours, theirs", [
    ("stage0_fp32", "all_reduce", "all_reduce | [Caller Func: allreduce_bucket]"),
    ("stage3_fp32", "reduce_scatter", "reduce_scatter_tensor | [Caller Func: reduce_scatter_fn]"),
    ("stage3_bf16", "reduce_scatter", "reduce_scatter_tensor | [Caller Func: reduce_scatter_fn]"),
])
def test_one_rank_logs_deepspeeds_gradient_reductions(name, ours, theirs):
    """Where dsplug averages gradients the way DeepSpeed does -- stage 0's one all-reduce of the
    whole bucket per optimizer step, stage 3's reduce-scatter per micro-step -- the one-rank log
    shows DeepSpeed's counts and sizes. (Both also issue collectives of their own that the other
    does not: DeepSpeed's norm / overflow all-reduces and stage-3 bookkeeping broadcasts and
    barriers, dsplug's packed stage-3 all-gathers; stages 1 and 2 reduce to partition owners in
    dsplug, and at one rank deliver locally without a collective.)"""
    _, after_training = _one_rank_records(name)
    assert after_training[ours] == DS_LOG["cases"][name]["after_training"][theirs]


def test_one_rank_stage0_builds_no_buckets_unless_collectives_are_watched():
    import dsplug

    model = DS_MAKER.make_model()
    config = DS_MAKER.config(0, False)
    del config["comms_logger"]
    engine, *_ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.stage.buckets is None  # nothing to average over one rank
    engine.destroy()
