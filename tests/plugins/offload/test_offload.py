"""Offload devices in one process: the plugins and their config, ZeRO-Offload (cpu) and
ZeRO-Infinity (nvme) at stage 3 trained against plain PyTorch and against the same run without
offloading, the ``ratio`` split, ``zero_force_ds_cpu_optimizer``, and the swap files: private,
removed at destroy, checked on read, refused before training when the directory is missing or
too small. Two-process runs (stages 2 and 3) are in test_offload_dist.py.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsplug
from dsplug.config import DsplugConfig
from dsplug.config.schema import ConfigError, parse

from tests.engine_common import reference_run
from tests.plugins.zero.test_zero3 import SeededMLP, adamw, config, gathered, train

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}  # == tests' torch AdamW
TIGHT = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)


def engine_for(zero: dict, precision=None, optimizer=None, section=ADAMW, **top):
    """A stage-3 engine over SeededMLP; the config's ``optimizer`` section unless a client one is given."""
    cfg = config(1, precision=precision, **zero)
    cfg.update(top)
    if optimizer is None:
        cfg["optimizer"] = section
    engine, *_ = dsplug.initialize(model=SeededMLP(), optimizer=optimizer, config=cfg)
    return engine


def run(zero: dict, precision=None, steps=3, **kw):
    engine = engine_for(zero, precision, **kw)
    try:
        return {"losses": train(engine, steps), "params": gathered(engine.module)}
    finally:
        engine.destroy()


@functools.lru_cache(maxsize=None)
def reference(precision: str = "fp32", steps: int = 3):
    return reference_run(steps, 2, 4, 1, adamw, precision=precision)


@functools.lru_cache(maxsize=None)
def not_offloaded(precision=None, steps: int = 3):
    return run({}, precision, steps)


def assert_same(got, want, tol):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(a, b, **tol)


def nvme(path, **more) -> dict:
    return {"device": "nvme", "nvme_path": str(path), **more}


# --------------------------------------------------------------------------- plugins and config
def test_none_cpu_and_nvme_are_installed_offload_plugins():
    from dsplug.registry import get_registry

    registry = get_registry()
    for name in ("none", "cpu", "nvme"):
        provided = registry.get("offload_device", name)
        assert provided.distribution == "dsplug" and provided.spec.factory is not None
    assert registry.sections()["aio"].name == "nvme"


def test_an_unknown_device_lists_the_installed_offload_plugins():
    with pytest.raises(ConfigError) as err:
        DsplugConfig({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvm"}}},
                     world_size=1)
    message = str(err.value)
    assert "zero_optimization.offload_optimizer.device" in message and "Did you mean 'nvme'?" in message
    assert "Installed offload_device plugins: cpu, none, nvme" in message


def test_aio_section_schema_defaults_alias_and_refusals():
    from dsplug.plugins.offload.config import AioConfig

    defaults = DsplugConfig({"train_batch_size": 2}, world_size=1).section("aio")
    assert (defaults.block_size, defaults.queue_depth, defaults.thread_count, defaults.single_submit,
            defaults.overlap_events, defaults.use_gds) == (1048576, 8, 1, False, True, False)
    # nvme-tune prints DeepNVMe's name for thread_count
    assert parse(AioConfig, {"intra_op_parallelism": 4, "queue_depth": 32}).thread_count == 4
    with pytest.raises(ConfigError) as err:
        DsplugConfig({"train_batch_size": 2, "aio": {"block_sise": 4096, "use_gds": True, "queue_depth": 0}},
                     world_size=1)
    message = str(err.value)
    assert "aio.block_sise: unknown key; did you mean 'aio.block_size'?" in message
    assert "aio.use_gds" in message and "GPUDirect Storage" in message
    assert "aio.queue_depth" in message


@pytest.mark.parametrize("zero,fragment", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "'cpu' needs ZeRO stage 1, 2 or 3"),
    ({"stage": 0, "offload_optimizer": {"device": "nvme"}}, "'nvme' needs ZeRO stage 1, 2 or 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "'nvme' needs ZeRO stage 3 .*stage is 2"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "ratio: 0.5: a partial offload needs ZeRO stage 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offloading parameters needs stage 3"),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": None}}, "device 'nvme' needs nvme_path"),
])
def test_offload_config_rules(zero, fragment):
    with pytest.raises(ConfigError, match=fragment):
        DsplugConfig({"train_batch_size": 2, "zero_optimization": zero}, world_size=1)


# --------------------------------------------------------------------------- splitting helpers
@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), ratio=st.floats(0, 1))
def test_host_share_is_the_longest_prefix_within_ratio(sizes, ratio):
    from dsplug.plugins.zero.partitioning.offload import host_share

    c = host_share(sizes, ratio)
    assert sum(sizes[:c]) <= ratio * sum(sizes) + 1e-9 or ratio >= 1
    assert c == len(sizes) or sum(sizes[:c + 1]) > ratio * sum(sizes)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), limit=st.integers(1, 120))
def test_sub_groups_cover_every_piece_in_runs_within_sub_group_size(sizes, limit):
    from dsplug.plugins.zero.partitioning.offload import sub_groups

    runs = sub_groups(sizes, 0, len(sizes), limit)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    for r in runs:
        assert len(r) == 1 or sum(sizes[i] for i in r) <= limit


# --------------------------------------------------------------------------- training equals the reference
CASES = {
    "cpu": {"offload_optimizer": {"device": "cpu"}},
    "cpu/cpu": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "param-cpu": {"offload_param": {"device": "cpu"}},
}


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_offload_trains_like_no_offload(case, precision):
    got = run(CASES[case], precision)
    assert_same(got, not_offloaded(precision), TIGHT)
    assert_same(got, reference("bf16" if precision else "fp32"), BF16 if precision else TIGHT)


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_and_2_cpu_offload_trains_like_no_offload(stage, precision):
    got = run({"stage": stage, "offload_optimizer": {"device": "cpu"}}, precision)
    assert_same(got, run({"stage": stage}, precision), TIGHT)
    assert_same(got, reference("bf16" if precision else "fp32"), BF16 if precision else TIGHT)


def test_stage_2_offload_steps_host_masters_with_cpu_adam():
    engine = engine_for({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16")
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in engine.stage.opt_params)
    train(engine, 1)
    assert engine.stage.offload.written_by_step  # bf16 host partitions written by cpu_adam's pass
    local = engine.stage.groups[0].local
    torch.testing.assert_close(local.float(), engine.stage.opt_params[0].to(torch.bfloat16).float(), rtol=0, atol=0)
    engine.destroy()
    with pytest.raises(ValueError, match="ZeRO stage 2.*zero_force_ds_cpu_optimizer"):
        engine_for({"stage": 2, "offload_optimizer": {"device": "cpu"}}, optimizer=adamw)


def nvme_case(tmp_path, pipeline: bool):
    return {"offload_optimizer": nvme(tmp_path, buffer_count=6, pipeline_read=pipeline, pipeline_write=pipeline),
            "offload_param": nvme(tmp_path, buffer_count=2, buffer_size=600, max_in_cpu=300),
            "sub_group_size": 200}


@pytest.mark.parametrize("precision,pipeline", [(None, True), ("bf16", False)])
def test_nvme_offload_trains_like_no_offload(tmp_path, precision, pipeline):
    got = run(nvme_case(tmp_path, pipeline), precision)
    assert_same(got, not_offloaded(precision), TIGHT)
    assert_same(got, reference("bf16" if precision else "fp32"), BF16 if precision else TIGHT)
    assert os.listdir(tmp_path) == []  # destroy() removed the private directories


@pytest.mark.parametrize("precision,gas,clip", [("fp16", 2, 0.3), ("bf16", 2, 0.3), (None, 1, 0.05)])
def test_swapped_gradients_train_like_no_offload_and_are_not_held_in_memory(tmp_path, precision, gas, clip):
    """With offload_optimizer on nvme the host share's gradients live in swap files: no gradient
    partition stays in memory after backward, the loss-scale unscaling and the clipping coefficient
    reach them at the step (fp16 / clipped runs equal the run without offloading), gradient
    accumulation rounds like the in-memory bf16 partitions, and the full gradient reads back."""
    zero = {"offload_optimizer": nvme(tmp_path, buffer_count=4), "sub_group_size": 200}

    def go(zero_section):
        cfg = config(1, gas=gas, clip=clip, precision=precision, **zero_section)
        cfg["optimizer"] = ADAMW
        engine, *_ = dsplug.initialize(model=SeededMLP(), config=cfg)
        try:
            losses = train(engine, 2)
            # one more backward: the gradients as they stand before the step
            from tests.engine_common import loss_fn
            from tests.plugins.zero.test_zero3 import local_batch

            x, y = local_batch(2, 0, 0, 1)
            engine.backward(loss_fn(engine(x.to(engine.precision.model_dtype)), y))
            grads = [dsplug.utils.safe_get_full_grad(p).float().clone() for p in engine.module.parameters()]
            store = engine.stage.store
            held = [g.grad for g in engine.stage.groups if g.grad is not None] + \
                [g.host_grad for g in engine.stage.groups if getattr(g, "host_grad", None) is not None]
            engine.step()
            return {"losses": losses, "params": gathered(engine.module), "grads": grads, "held": held,
                    "swapped": getattr(store, "grads", None)}
        finally:
            engine.destroy()

    got, want = go(zero), go({})
    assert got["swapped"] is not None and want["swapped"] is None
    assert got["held"] == []  # ratio 1: every gradient partition is in the swap files
    tol = TIGHT if precision is None else dict(rtol=2e-3, atol=2e-3)
    assert_same(got, want, tol)
    for a, b in zip(got["grads"], want["grads"]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("buffers,read,write,reads_ahead,overlapped_writes", [
    (11, True, True, "all", "all"), (8, True, True, "all", "last"), (7, False, True, "none", "all"),
    (5, True, True, "none", "none"), (11, False, False, "none", "none")])
def test_pipelining_overlaps_the_next_read_and_the_last_writes_with_the_step(tmp_path, buffers, read, write,
                                                                            reads_ahead, overlapped_writes):
    """Adam reads 4 tensors per sub-group (master, gradient, two moments) and writes 3 back: reading
    the next one ahead needs 8 buffers, also leaving the previous one's writes running needs 11 (with 8,
    reading ahead wins: only the last sub-group of a step, which reads nothing ahead, overlaps writes).
    Counted per step over the sub-groups after the first."""
    zero = {"offload_optimizer": nvme(tmp_path, buffer_count=buffers, pipeline_read=read, pipeline_write=write),
            "sub_group_size": 200}
    engine = engine_for(zero)
    got = {"losses": train(engine, 3), "params": gathered(engine.module)}
    store = engine.stage.store
    count = {"all": 3 * (len(store.units) - 1), "last": 3, "none": 0}
    assert len(store.units) >= 3
    assert store.reads_ahead == count[reads_ahead]
    assert store.steps_during_writes == count[overlapped_writes]
    engine.destroy()
    assert_same(got, not_offloaded(), TIGHT)


def test_nvme_with_a_torch_optimizer_learns_its_state_on_the_first_step(tmp_path):
    # zero_force_ds_cpu_optimizer=false: torch.optim.AdamW steps the swapped-in sub-groups; its
    # state (exp_avg, exp_avg_sq, step tensors) is discovered and swapped after the first step
    zero = {"offload_optimizer": nvme(tmp_path, fast_init=True), "sub_group_size": 300}
    got = run(zero, optimizer=adamw, zero_force_ds_cpu_optimizer=False)
    assert_same(got, reference(), TIGHT)


# --------------------------------------------------------------------------- the CPU optimizer
def test_config_adam_and_adagrad_become_deepspeed_cpu_optimizers():
    engine = engine_for(CASES["cpu"])
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam" and engine.optimizer.adamw_mode
    assert all(p.device.type == "cpu" for g in engine.optimizer.param_groups for p in g["params"])
    engine.destroy()
    engine = engine_for(CASES["cpu"], section={"type": "Adagrad", "params": {"lr": 0.05}})
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdagrad"
    assert engine.optimizer.param_groups[0]["lr"] == 0.05
    engine.destroy()


def test_zero_force_ds_cpu_optimizer_refuses_other_optimizers():
    with pytest.raises(ValueError) as err:
        engine_for(CASES["cpu"], optimizer=adamw)
    message = str(err.value)
    assert "torch.optim.adamw.AdamW" in message and "client optimizer" in message
    assert '"zero_force_ds_cpu_optimizer": false' in message and "DeepSpeedCPUAdam" in message
    with pytest.raises(ValueError, match=r"config's optimizer 'SGD'"):
        engine_for(CASES["cpu"], section={"type": "SGD", "params": {"lr": 0.1}}, zero_allow_untested_optimizer=True)


def test_torch_adam_by_name_steps_the_cpu_partitions_under_force():
    """``torch_adam: true`` asks for torch's class by name: DeepSpeed steps it on the host partitions
    even while zero_force_ds_cpu_optimizer is true, and so does dsplug."""
    engine = engine_for(CASES["cpu"], section={"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}})
    assert type(engine.optimizer.optimizer) is torch.optim.AdamW
    assert all(p.device.type == "cpu" for g in engine.optimizer.param_groups for p in g["params"])
    train(engine, 1)
    engine.destroy()


def test_without_force_a_torch_optimizer_steps_the_cpu_partitions():
    got = run(CASES["cpu"], optimizer=adamw, zero_force_ds_cpu_optimizer=False)
    assert_same(got, reference(), TIGHT)


def test_ratio_splits_the_step_between_host_and_device():
    from dsplug.plugins.zero.partitioning.offload import SplitOptimizer

    engine = engine_for({"offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    opt = engine.optimizer.optimizer
    assert isinstance(opt, SplitOptimizer) and type(opt.host).__name__ == "DeepSpeedCPUAdam"
    host = [p for g in opt.host.param_groups for p in g["params"]]
    device = [p for g in opt.device.param_groups for p in g["params"]]
    total = sum(p.numel() for g in opt.param_groups for p in g["params"])
    # SeededMLP's partitions: 288, 24, 576, 24, 72, 3 elements: the first two fit in half of 987
    assert [p.numel() for p in host] == [288, 24] and len(device) == 4
    assert sum(p.numel() for p in host) <= 0.5 * total < sum(p.numel() for p in host) + device[0].numel()
    train(engine, 2)
    assert all(p in opt.host.state and opt.host.state[p]["step"] == 2 for p in host)
    assert all(p in opt.device.state for p in device)
    for g in opt.param_groups:  # a scheduler changes the split optimizer's groups; both parts follow
        g["lr"] = 0.0
    before = gathered(engine.module)
    train(engine, 1, start=2)
    for a, b in zip(before, gathered(engine.module)):
        assert torch.equal(a, b)
    assert opt.host.param_groups[0]["lr"] == 0.0 and opt.device.param_groups[0]["lr"] == 0.0
    engine.destroy()
    assert_same(run({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}), reference(), TIGHT)


def test_ratio_zero_keeps_the_whole_step_on_the_device():
    engine = engine_for({"offload_optimizer": {"device": "cpu", "ratio": 0.0}})
    assert type(engine.optimizer.optimizer).__name__ != "SplitOptimizer"
    assert not engine.stage.store.groups[0].host_count
    engine.destroy()


def test_16bit_partitions_are_written_by_cpu_adam_in_the_same_pass():
    engine = engine_for(CASES["cpu"], "bf16")
    store = engine.stage.store
    assert store.fp16_outputs is not None
    flat = store.groups[0].flat
    assert all(out.data_ptr() >= flat.data_ptr() for out in store.fp16_outputs[0])
    train(engine, 1)
    torch.testing.assert_close(flat.float(), store.groups[0].host_master.to(torch.bfloat16).float(), rtol=0, atol=0)
    engine.destroy()


# --------------------------------------------------------------------------- swap files
def test_swap_files_are_private_exist_while_training_and_are_removed_at_destroy(tmp_path):
    engine = engine_for(nvme_case(tmp_path, pipeline=True), aio={"queue_depth": 4, "intra_op_parallelism": 2})
    train(engine, 1)
    store = engine.stage.store
    files = store.opt_device.files  # the nvme device's aio handles
    assert (files.reader.get_queue_depth(), files.reader.get_intra_op_parallelism()) == (4, 2)
    assert files.writer.get_overlap_events() is True  # the aio section's default
    dirs = sorted(os.listdir(tmp_path))
    assert len(dirs) == 2 and dirs[0].startswith("dsplug-offload_optimizer-rank0-") \
        and dirs[1].startswith("dsplug-offload_param-rank0-")
    files = store.swap_files()
    names = {os.path.basename(f) for f in files}
    units = len(store.units)
    assert units >= 3  # sub_group_size 200 cuts the 987 partition elements into several sub-groups
    assert sum(n.endswith("_master.swp") for n in names) == units
    assert sum(n.endswith("_exp_avg.swp") for n in names) == units == sum(n.endswith("_exp_avg_sq.swp") for n in names)
    resident, swapped = engine.stage.partitioner.plan()
    # max_in_cpu = 300 partition elements: 0.weight (288) and 4.bias (3) stay, the other four are swapped
    names_of = {id(p): n for n, p in engine.module.named_parameters()}
    assert [names_of[id(p)] for p in resident] == ["0.weight", "4.bias"]
    assert sum(n.startswith("param") for n in names) == len(swapped) == 4
    assert all(f.startswith(str(tmp_path)) for f in files)
    # optimizer states live in the files: no state tensors held between steps
    assert engine.model_state_memory()["optimizer_states"] == 0
    assert engine.stage.partitioner.pool.count == 2 and engine.stage.partitioner.reads > 0
    engine.destroy()
    assert os.listdir(tmp_path) == []


def _fake_swap_dir(root, name, owner):
    d = root / name
    d.mkdir()
    (d / "opt_group0_master.swp").write_bytes(b"\0" * 5000)
    (d / "sub").mkdir()
    (d / "sub" / "x.swp").write_bytes(b"\1" * 100)
    if owner is not None:
        from dsplug.plugins.offload.swap import OWNER_FILE

        (d / OWNER_FILE).write_text(json.dumps(owner))
    return d


def test_swap_dirs_of_dead_runs_on_this_host_are_reclaimed_at_initialize(tmp_path, capsys):
    from dsplug.plugins.offload.swap import OWNER_FILE, current_owner, read_owner

    me = current_owner()
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its pid is now free: a run that died without cleaning up
    dead = dict(me, pid=finished.pid, start_time=None)
    stale = _fake_swap_dir(tmp_path, f"dsplug-offload_optimizer-rank0-pid{finished.pid}-abc", dead)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        kept = {
            "live": _fake_swap_dir(tmp_path, "dsplug-offload_param-rank1-live",
                                   dict(me, pid=live.pid, start_time=None)),
            "mine": _fake_swap_dir(tmp_path, "dsplug-offload_param-rank0-mine", me),
            "other host": _fake_swap_dir(tmp_path, "dsplug-offload_optimizer-rank0-elsewhere",
                                         dict(dead, host=me["host"] + "-other")),
            "no owner": _fake_swap_dir(tmp_path, "dsplug-offload_optimizer-rank0-old", None),
            "not dsplug's": _fake_swap_dir(tmp_path, "mydata", dead),
        }
        capsys.readouterr()
        engine = engine_for({"offload_optimizer": nvme(tmp_path)})
        out = capsys.readouterr().out
        assert not stale.exists(), out
        assert re.search(rf"removed the stale swap directory {re.escape(str(stale))} \(5\.\d KiB\) left by process "
                         rf"{finished.pid} on {re.escape(me['host'])}: that process is no longer running", out), out
        assert out.count("removed the stale swap directory") == 1
        for why, d in kept.items():
            assert (d / "opt_group0_master.swp").is_file(), why
        # this run's own directory names its owner, so the next run can tell whether it is alive
        prefix = f"dsplug-offload_optimizer-rank0-pid{os.getpid()}-"
        (mine,) = [d for d in tmp_path.iterdir() if d.name.startswith(prefix)]
        assert read_owner(str(mine)) == current_owner()
        assert all(OWNER_FILE not in f for f in engine.stage.store.swap_files())
        engine.destroy()
        assert not mine.exists()
    finally:
        live.kill()
        live.wait()


def test_reclaiming_a_reused_pid_a_rebooted_host_and_an_unfinished_removal(tmp_path):
    from dsplug.plugins.offload.swap import _start_time, current_owner, owner_is_dead, reclaim_stale_swap_dirs

    me = current_owner()
    lines = []
    assert not owner_is_dead(me, me)  # this very process
    # a live pid (our parent's) recorded with another start time: the owner died and the pid was reused
    parent_start = _start_time(os.getppid())
    reused = _fake_swap_dir(tmp_path, "dsplug-a", dict(me, pid=os.getppid(), start_time=(parent_start or 0) + 1))
    assert not owner_is_dead(dict(me, pid=os.getppid(), start_time=parent_start), me)  # the same process: alive
    rebooted = _fake_swap_dir(tmp_path, "dsplug-b", dict(me, pid=1, boot_id="another-boot"))
    other_ns = _fake_swap_dir(tmp_path, "dsplug-c", dict(me, pid=2 ** 22 + 1, pid_namespace="pid:[1]"))
    # a reclaimer that died half-way (its pid is gone): finished by the next run
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    unfinished = _fake_swap_dir(tmp_path, f"dsplug-d.reclaiming-{gone.pid}", dict(me, pid=gone.pid, start_time=None))
    # one being removed right now by a live process: left to it
    busy = _fake_swap_dir(tmp_path, f"dsplug-e.reclaiming-{os.getppid()}", dict(me, pid=gone.pid, start_time=None))
    removed = reclaim_stale_swap_dirs(str(tmp_path), log=lines.append)
    if me["start_time"] is not None:  # /proc is there: a pid reused by another process is detected
        assert str(reused) in removed and not reused.exists()
    if me["boot_id"] is not None:
        assert str(rebooted) in removed and "the machine has restarted since" in " ".join(lines)
    assert str(tmp_path / "dsplug-d") in removed and not unfinished.exists()
    assert other_ns.exists() and busy.exists()
    assert len(lines) == len(removed)


def test_a_corrupted_swap_file_is_detected_with_its_name(tmp_path, monkeypatch):
    from dsplug.plugins.offload.swap import SwapCorruptionError

    monkeypatch.setenv("DSPLUG_DEBUG_SWAP", "1")
    engine = engine_for({"offload_optimizer": nvme(tmp_path)})
    train(engine, 1)
    victim = next(f for f in engine.stage.store.swap_files() if f.endswith("_exp_avg_sq.swp"))
    with open(victim, "r+b") as f:  # same size, different bytes
        data = bytearray(f.read())
        data[5] ^= 0xFF
        f.seek(0)
        f.write(data)
    with pytest.raises(SwapCorruptionError, match=f"swap file {victim} is corrupted: the CRC-32"):
        train(engine, 1, start=1)
    engine.destroy()


def test_a_truncated_swap_file_is_detected_without_debug_mode(tmp_path, monkeypatch):
    from dsplug.plugins.offload.swap import SwapCorruptionError

    monkeypatch.delenv("DSPLUG_DEBUG_SWAP", raising=False)
    engine = engine_for({"offload_optimizer": {"device": "cpu"}, "offload_param": nvme(tmp_path, max_in_cpu=0)})
    victim = engine.stage.store.swap_files()[0]
    os.truncate(victim, 8)
    with pytest.raises(SwapCorruptionError, match=f"swap file {victim} has 8 bytes but .* were written"):
        train(engine, 1)
    engine.destroy()


def test_a_missing_or_non_directory_nvme_path_is_refused_before_training(tmp_path):
    from dsplug.plugins.offload.swap import SwapError

    missing = tmp_path / "no-such-dir"
    with pytest.raises(SwapError, match=f"zero_optimization.offload_optimizer.nvme_path = '{missing}' does not exist"):
        engine_for({"offload_optimizer": nvme(missing)})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SwapError, match=f"offload_param.nvme_path = '{a_file}' is not a directory"):
        engine_for({"offload_param": nvme(a_file)})


def test_a_too_small_disk_is_refused_before_training_with_the_bytes(tmp_path, monkeypatch):
    from dsplug.plugins.offload import swap

    real = os.statvfs

    def small(path):
        st = real(path)
        return types.SimpleNamespace(f_bavail=2, f_frsize=4096, f_bsize=st.f_bsize)

    monkeypatch.setattr(swap.os, "statvfs", small)
    with pytest.raises(swap.SwapError) as err:
        engine_for({"offload_optimizer": nvme(tmp_path)})
    message = str(err.value)
    # fp32 master + fp32 gradient + exp_avg + exp_avg_sq of the 987 partition elements
    assert f"'{tmp_path}'" in message and f"needs 15.4 KiB ({987 * 16} bytes)" in message
    assert "only 8.0 KiB (8192 bytes) are available" in message
    assert os.listdir(tmp_path) == []


def test_parameter_buffer_size_must_hold_the_largest_partition(tmp_path):
    from dsplug.plugins.offload.swap import SwapError

    with pytest.raises(SwapError, match=r"buffer_size = 500 elements is smaller than the partition of parameter "
                                        r"'2.weight' \(576 elements\)"):
        engine_for({"offload_param": nvme(tmp_path, buffer_size=500, max_in_cpu=0)})
    assert os.listdir(tmp_path) == []


def test_optimizer_buffer_count_must_hold_a_sub_group(tmp_path):
    from dsplug.plugins.offload.swap import SwapError

    with pytest.raises(SwapError, match=r"buffer_count = 2 is too small: .* 2 optimizer state\(s\) "
                                        r"\(exp_avg, exp_avg_sq\) .* at least 4 buffers"):
        engine_for({"offload_optimizer": nvme(tmp_path, buffer_count=2)})


# --------------------------------------------------------------------------- checkpoints
def test_nvme_checkpoint_resumes_like_the_uninterrupted_run(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    engine = engine_for(nvme_case(tmp_path / "a", pipeline=True), "bf16")
    first = train(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    uninterrupted = first + train(engine, 2, start=2)
    final = gathered(engine.module)
    engine.destroy()
    for zero in (nvme_case(tmp_path / "b", pipeline=False), {}):  # into swap files, and into memory
        other = engine_for(zero, "bf16")
        other.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        resumed = first + train(other, 2, start=2)
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), **TIGHT)
        for a, b in zip(gathered(other.module), final):
            torch.testing.assert_close(a, b, **TIGHT)
        other.destroy()


def test_ratio_checkpoint_resumes_like_the_uninterrupted_run(tmp_path):
    zero = {"offload_optimizer": {"device": "cpu", "ratio": 0.4}}
    engine = engine_for(zero, "bf16")
    first = train(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    uninterrupted = first + train(engine, 2, start=2)
    engine.destroy()
    other = engine_for(zero, "bf16")
    other.load_checkpoint(str(tmp_path), tag="t")
    resumed = first + train(other, 2, start=2)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), **TIGHT)
    other.destroy()


# --------------------------------------------------------------------------- zero.Init, pinning
def test_zero_init_with_an_offload_config_partitions_on_the_host(tmp_path):
    zero = {"offload_optimizer": nvme(tmp_path), "offload_param": nvme(tmp_path, max_in_cpu=0)}
    cfg = config(1, **zero)
    cfg["optimizer"] = ADAMW
    with dsplug.zero.Init(config_dict_or_path=cfg) as init:
        model = SeededMLP()
    assert init.partitioner.partition_device == torch.device("cpu")
    engine, *_ = dsplug.initialize(model=model, config=cfg)
    got = {"losses": train(engine, 3), "params": gathered(engine.module)}
    engine.destroy()
    assert_same(got, not_offloaded(), TIGHT)


class _PinningAccelerator:
    """The CPU accelerator under another name, recording what it is asked to page-lock."""

    def __new__(cls):
        from dsplug.plugins.accelerators.cpu import CpuAccelerator

        class Pinning(CpuAccelerator):
            name = "pinning-test"
            pinned = []

            def device_name(self, index=None):
                return "cpu"

            def pin_memory(self, tensor):
                out = tensor.clone()
                self.pinned.append(out)
                return out

            def is_pinned(self, tensor):
                return any(t.data_ptr() == tensor.data_ptr() for t in self.pinned)

        return Pinning()


@pytest.mark.parametrize("pin", [True, False])
def test_pin_memory_page_locks_host_buffers_through_the_accelerator(monkeypatch, pin):
    accelerator = _PinningAccelerator()
    monkeypatch.setattr("dsplug.engine.get_accelerator", lambda *a, **k: accelerator)
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": pin}, "offload_param": {"device": "cpu",
                                                                                          "pin_memory": pin}}
    engine = engine_for(zero)
    grp = engine.stage.store.groups[0]
    pinned = {t.data_ptr() for t in accelerator.pinned}
    held = [grp.host_master, grp.host_grad, grp.flat]
    assert all((t.data_ptr() in pinned) == pin for t in held)
    got = {"losses": train(engine, 3), "params": gathered(engine.module)}
    engine.destroy()
    assert_same(got, not_offloaded(), TIGHT)
    accelerator.pinned.clear()
    engine = engine_for({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin}})
    train(engine, 1)
    pinned = {t.data_ptr() for t in accelerator.pinned}
    held = engine.stage.opt_params + list(engine.stage.offload.host_grads.values())
    assert held and all((t.data_ptr() in pinned) == pin for t in held)
    engine.destroy()
