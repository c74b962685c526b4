"""The engine at ZeRO stage 0 against plain-PyTorch reference loops, on 1 and 2 processes."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

import dsplug
from dsplug.config import ConfigError

from tests.dist_harness import run_distributed
from tests.engine_common import assert_close_runs, dsplug_run, make_model, reference_run


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


CASES = {
    # name: (config extras, reference kwargs)
    "fp32": ({}, {}),
    "fp32-accum-clip": ({"gradient_accumulation_steps": 2, "gradient_clipping": 0.3}, {"gas": 2, "clip": 0.3}),
    "fp16": ({"fp16": {"enabled": True, "initial_scale_power": 6}}, {"precision": "fp16", "scale": 64.0}),
    "fp16-accum-fp32": ({"fp16": {"enabled": True, "loss_scale": 32}, "gradient_accumulation_steps": 2,
                         "data_types": {"grad_accum_dtype": "fp32"}, "gradient_clipping": 0.5},
                        {"precision": "fp16", "scale": 32.0, "gas": 2, "clip": 0.5}),
    "bf16-accum-clip": ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3},
                        {"precision": "bf16", "gas": 2, "clip": 0.3}),
    "amp": ({"amp": {"enabled": True}}, {"precision": "amp"}),
}
TOLERANCE = {"fp16": dict(rtol=2e-3, atol=2e-3), "bf16": dict(rtol=2e-2, atol=2e-2)}


def _case(name, world, steps=4, micro=4):
    extra, ref = CASES[name]
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 1000, **extra}
    gas = ref.get("gas", 1)
    want = reference_run(steps, world, micro, gas, adamw, clip=ref.get("clip", 0.0),
                         precision=ref.get("precision", "fp32"), scale=ref.get("scale", 1.0))
    return config, want


def _train_case(name, world, steps):
    config, _ = _case(name, world, steps)
    return dsplug_run(config, steps, optimizer=adamw)


@pytest.mark.parametrize("name", list(CASES))
def test_single_process_equals_reference(name):
    config, want = _case(name, 1)
    got = dsplug_run(config, 4, optimizer=adamw)
    tol = TOLERANCE.get(name.split("-")[0], {})
    assert_close_runs(got, want, **tol)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fp32-accum-clip", "bf16-accum-clip", "fp16"])
def test_two_processes_equal_reference_on_global_batch(name):
    _, want = _case(name, 2)
    results = run_distributed(_train_case, 2, name, 2, 4)
    tol = TOLERANCE.get(name.split("-")[0], dict(rtol=1e-5, atol=1e-6))
    for got in results:
        assert_close_runs(got, want, **tol)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "ranks diverged"


def _train_comm_options(extra):
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, **extra}
    return dsplug_run(config, 3, optimizer=sgd)


@pytest.mark.multiprocess
def test_communication_options_give_the_same_average():
    """prescale / predivide / fp32 / bf16 communication all average the same gradients."""
    want = reference_run(3, 2, 4, 1, sgd)
    for extra, tol in [({"prescale_gradients": True}, 1e-5), ({"gradient_predivide_factor": 2.0}, 1e-5),
                       ({"communication_data_type": "bf16"}, 3e-2)]:
        got = run_distributed(_train_comm_options, 2, extra)[0]
        assert_close_runs(got, want, rtol=tol, atol=tol)


class _ByteCounter:
    def __init__(self):
        self.bytes = 0

    @dsplug.hookimpl
    def dsplug_comm_op(self, op, nbytes):
        if op == "all_reduce" and nbytes > 64:  # skip the test's own 4-byte loss all-reduce
            self.bytes += nbytes


def _gradient_bytes(extra):
    from dsplug import comm

    counter = _ByteCounter()
    comm.events.register(counter)
    _train_comm_options(extra)
    return counter.bytes


@pytest.mark.multiprocess
def test_communication_data_type_changes_the_bytes_communicated():
    fp32 = run_distributed(_gradient_bytes, 2, {})[0]
    bf16 = run_distributed(_gradient_bytes, 2, {"communication_data_type": "bf16"})[0]
    n_params = sum(p.numel() for p in make_model().parameters())
    assert fp32 == 3 * n_params * 4  # one all-reduce of every gradient per step, 3 steps
    assert bf16 * 2 == fp32


# --------------------------------------------------------------------------- fp16 loss scaling
def test_fp16_overflow_skips_step_lowers_scale_and_is_logged(caplog):
    """Dynamic scaling with hysteresis 2: the first overflow uses up hysteresis, the second halves."""
    def inject(engine, step):
        if step in (1, 2):
            next(engine.module.parameters()).grad.fill_(float("inf"))

    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 6, "hysteresis": 2, "loss_scale_window": 1000}}
    model_before = make_model(0)
    import dsplug.logging  # noqa: F401  (configures the logger first, so the line below sticks)

    with caplog.at_level(logging.INFO, logger="dsplug"):
        logger = logging.getLogger("dsplug")
        logger.propagate = True
        try:
            got = dsplug_run(config, 4, optimizer=sgd, inject=inject)
        finally:
            logger.propagate = False
    assert got["skipped"] == 2
    assert got["scale"] == 32.0  # 64 -> (hysteresis) 64 -> 32
    assert "overflow: step 2 skipped" in caplog.text and "overflow: step 3 skipped" in caplog.text
    # the skipped steps changed nothing: equal to 2 real steps of the reference on steps 0 and 3
    assert not any(torch.equal(a, b.float()) for a, b in zip(got["params"], model_before.parameters()))


def test_dynamic_scale_grows_after_window():
    from dsplug.plugins.precision.loss_scaler import DynamicScaler

    s = DynamicScaler(initial_scale_power=4, scale_window=3, hysteresis=1, min_scale=2.0)
    seen = []
    for overflow in [False, False, False, True, False, False, False, True, True, True]:
        s.update(overflow)
        seen.append(s.scale)
    # doubles after every `scale_window` overflow-free iterations; halves on each overflow
    assert seen == [16, 16, 32, 16, 16, 16, 32, 16, 8, 4]


def test_consecutive_hysteresis_refills_on_each_good_step():
    from dsplug.plugins.precision.loss_scaler import DynamicScaler

    plain = DynamicScaler(initial_scale_power=4, scale_window=100, hysteresis=2)
    refill = DynamicScaler(initial_scale_power=4, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    for s in (plain, refill):
        for overflow in [False, True, False, True]:
            s.update(overflow)
    assert plain.scale == 8.0  # the 1st overflow spends the hysteresis, the 2nd halves
    assert refill.scale == 16.0  # the good step in between refilled the hysteresis


# --------------------------------------------------------------------------- API surface
def test_add_config_arguments_and_initialize_from_args(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "gradient_accumulation_steps": 2}')
    parser = dsplug.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, optimizer, loader, scheduler = dsplug.initialize(args=args, model=make_model(), optimizer=sgd)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (8, 4, 2)
    assert optimizer is engine.optimizer and loader is None and scheduler is None
    assert engine.zero_optimization_stage() == 0
    with pytest.raises(ValueError, match="given more than once"):
        dsplug.initialize(args=args, model=make_model(), optimizer=sgd, config={"train_batch_size": 8})


def test_initialize_refuses_a_wrong_config_with_every_error():
    with pytest.raises(ConfigError) as err:
        dsplug.initialize(model=make_model(), optimizer=sgd,
                          config={"train_batch_size": 8, "fp16": {"enabled": True, "loss_scal": 0},
                                  "bf16": {"enabled": True}})
    text = str(err.value)
    assert "fp16.loss_scal: unknown key; did you mean 'fp16.loss_scale'?" in text
    assert "fp16 and bf16 are both enabled" in text


def test_amp_with_zero_is_refused():
    from dsplug.config import DsplugConfig

    DsplugConfig({"train_batch_size": 2, "amp": {"enabled": True}, "zero_optimization": {"stage": 0}}, world_size=1)
    with pytest.raises(ConfigError, match=r"amp\.enabled: amp cannot be combined with ZeRO"):
        DsplugConfig({"train_batch_size": 2, "amp": {"enabled": True}, "zero_optimization": {"stage": 2}},
                     world_size=1)


def test_training_data_loader_uses_micro_batch_and_shards():
    data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).view(20, 2))
    engine, _, loader, _ = dsplug.initialize(model=make_model(), optimizer=sgd, training_data=data,
                                             config={"train_batch_size": 5})
    sizes = [len(b[0]) for b in loader]
    assert sizes == [5, 5, 5, 5]
    seen = torch.cat([b[0][:, 0] for b in loader]).sort().values
    assert torch.equal(seen, torch.arange(0, 40, 2, dtype=torch.float32))


def test_client_scheduler_callable_and_lr_queries():
    engine, opt, _, sched = dsplug.initialize(
        model=make_model(), optimizer=sgd, config={"train_batch_size": 4},
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    x = torch.randn(4, 12)
    for _ in range(3):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert engine.get_lr() == [pytest.approx(0.05 * 0.5 ** 3)]
    assert engine.global_steps == 3 and engine.global_samples == 12
    assert engine.get_mom() == [0.9]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_scheduler_object_on_the_client_optimizer_drives_the_engine(stage):
    """The usual pairing (an optimizer and a scheduler built on it, both passed): the engine steps
    that scheduler and its learning rates reach the optimizer that trains, at any stage."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, opt, _, sched = dsplug.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                              config={"train_batch_size": 4, "zero_optimization": {"stage": stage}})
    assert sched is scheduler
    x = torch.randn(4, 12)
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.025)] and engine.get_lr() == [pytest.approx(0.025)]


@pytest.mark.parametrize("optimizer", ["config", "callable"])
def test_a_scheduler_object_on_another_optimizer_is_refused(optimizer):
    """A scheduler built on an optimizer the engine does not train with would step the learning rate
    of an optimizer that never steps (DeepSpeed asserts; so the error is also an AssertionError)."""
    from dsplug.engine import SchedulerBindingError

    model = make_model()
    elsewhere = torch.optim.Adam(model.parameters())
    config = {"train_batch_size": 4}
    if optimizer == "config":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    with pytest.raises(SchedulerBindingError) as info:
        dsplug.initialize(model=model, config=config, optimizer=sgd if optimizer == "callable" else None,
                          lr_scheduler=torch.optim.lr_scheduler.LambdaLR(elsewhere, lambda epoch: 1.0))
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    message = str(info.value)
    assert "lr_scheduler (LambdaLR) was built on another optimizer (Adam;" in message
    assert ("optimizer callable" if optimizer == "callable" else "config's 'optimizer' section") in message
    assert "as a callable optimizer -> scheduler" in message


def test_a_passed_optimizer_and_scheduler_take_the_place_of_the_config_sections(capsys):
    """As DeepSpeed documents: initialize's optimizer / lr_scheduler override the config's sections
    (which are still checked); the log says the section is not used."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, opt, _, sched = dsplug.initialize(
        model=model, optimizer=optimizer, config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert opt is optimizer and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    out = capsys.readouterr().out
    assert "the config's 'optimizer' section ('Adam') is not used: initialize() was given optimizer=" in out
    assert "the config's 'scheduler' section ('WarmupLR') is not used: initialize() was given lr_scheduler=" in out
    x = torch.randn(4, 12)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.05)]
    with pytest.raises(ConfigError, match="optimizer.params.lrr"):  # the section is still checked
        dsplug.initialize(model=make_model(), optimizer=sgd,
                          config={"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lrr": 1}}})


def test_a_passed_optimizer_under_offload_is_the_one_that_trains():
    """With optimizer offload, the host optimizer is built from the passed callable, not from the
    overridden config section (which would have selected the native CPU Adam)."""
    config = {"train_batch_size": 4, "zero_force_ds_cpu_optimizer": False,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, opt, _, _ = dsplug.initialize(model=make_model(), optimizer=sgd, config=config)
    assert type(opt.optimizer) is torch.optim.SGD and opt.optimizer is engine.basic_optimizer


def test_the_models_own_attributes_pass_through_the_engine():
    """As DeepSpeed's engine: an attribute the engine does not have is the model's (its
    TestZero3ClientModuleID reads ``engine.id``); the engine's own names win."""
    model = make_model()
    model.id = 3
    model.config = "the model's"
    model.describe = lambda: "a method of the model"
    engine = dsplug.initialize(model=model, optimizer=sgd, config={"train_batch_size": 4})[0]
    assert engine.id == 3 and engine.describe() == "a method of the model"
    assert engine.config is not model.config and engine.module.config == "the model's"
    with pytest.raises(AttributeError, match="'Engine' object has no attribute 'no_such' \\(nor has its model"):
        engine.no_such


def test_steps_per_print_and_wall_clock_breakdown_lines(capsys):
    engine, _, _, _ = dsplug.initialize(model=make_model(), optimizer=sgd, config={
        "train_batch_size": 4, "steps_per_print": 2, "wall_clock_breakdown": True})
    x = torch.randn(4, 12)
    for _ in range(4):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[dsplug] step=")]
    assert [l.split(",")[0] for l in lines] == ["[dsplug] step=2", "[dsplug] step=4"]
    assert all("forward_ms=" in l and "backward_ms=" in l and "step_ms=" in l for l in lines)
    assert "skipped=0" in lines[0] and "lr=[0.05]" in lines[0]


def test_dump_state_prints_the_resolved_config(capsys):
    dsplug.initialize(model=make_model(), optimizer=sgd, config={"train_batch_size": 4, "dump_state": True})
    out = capsys.readouterr().out
    assert '"train_micro_batch_size_per_gpu": 4' in out and "precision=fp32" in out and "zero_stage=0" in out


def test_config_scheduler_steps_once_per_optimizer_step_and_not_on_overflow():
    """WarmupLR (linear) from the config. As in DeepSpeed, the scheduler's k-th step() sets the lr of
    iteration k-1: after k applied optimizer steps, lr = min + (max - min)·(k - 1)/warmup."""
    def inject(engine, step):
        if step == 2:
            next(engine.module.parameters()).grad.fill_(float("nan"))

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 10, "warmup_type": "linear"}}}
    got = dsplug_run(config, 5, optimizer=sgd, inject=inject)
    applied = [1, 2, 2, 3, 4]  # step index 2 overflowed: the schedule did not advance
    assert got["lrs"] == pytest.approx([0.1 * (k - 1) / 10 for k in applied])
    assert got["skipped"] == 1


def test_model_built_under_zero_init_needs_stage_3():
    with dsplug.zero.Init():
        model = make_model()
    with pytest.raises(ValueError, match="built under dsplug.zero.Init.*zero_optimization.stage is 0; use stage 3"):
        dsplug.initialize(model=model, optimizer=sgd, config={"train_batch_size": 4})


def test_stage0_refuses_a_partitioned_checkpoint_clearly(tmp_path):
    from dsplug.checkpoint import CheckpointError

    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
    engine, _, _, _ = dsplug.initialize(model=make_model(), optimizer=sgd, config=config)
    engine.save_checkpoint(tmp_path)
    plain, _, _, _ = dsplug.initialize(model=make_model(), optimizer=sgd, config={"train_batch_size": 4})
    with pytest.raises(CheckpointError, match="holds ZeRO stage 3 partitions, but the engine runs stage 0"):
        plain.load_checkpoint(tmp_path)
    path, _ = plain.load_checkpoint(tmp_path, load_module_only=True)
    for a, b in zip(plain.module.parameters(), engine.stage.module_state_dict().values()):
        assert torch.equal(a.detach(), b)


def test_client_optimizer_groups_keep_their_place_when_one_is_frozen():
    model = make_model()
    first = model[0]
    for p in first.parameters():
        p.requires_grad_(False)
    rest = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD([{"params": list(first.parameters()), "lr": 0.5}, {"params": rest, "lr": 0.01}])
    reference = make_model()
    ref_opt = torch.optim.SGD([p for i, p in enumerate(reference.parameters()) if i >= 2], lr=0.01)
    engine, optimizer, _, _ = dsplug.initialize(model=model, optimizer=opt, config={"train_batch_size": 4})
    assert optimizer.param_groups[0]["params"] == [] and optimizer.param_groups[0]["lr"] == 0.5
    assert len(optimizer.param_groups[1]["params"]) == len(rest)
    x = torch.randn(4, 12)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    reference(x).pow(2).mean().backward()
    ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())


def test_initialize_twice_on_one_model_retires_the_first_engine(capsys):
    model = make_model()
    config = {"train_batch_size": 4, "bf16": {"enabled": True}}
    first, _, _, _ = dsplug.initialize(model=model, optimizer=sgd, config=config)
    second, _, _, _ = dsplug.initialize(model=model, optimizer=sgd, config=config)
    assert "already wrapped by a dsplug engine" in capsys.readouterr().out
    x = torch.randn(4, 12, dtype=torch.bfloat16)
    for _ in range(2):  # the first engine's gradient hooks no longer take the gradients away
        second.backward(second(x).float().pow(2).mean())
        second.step()
    assert second.global_steps == 2 and first.global_steps == 0


def test_bf16_check_grad_overflow_skips_non_finite_steps():
    def inject(engine, step):
        if step == 1:  # bf16 gradients live in the stage's fp32 accumulators
            engine.stage._grad_of(next(engine.module.parameters())).fill_(float("inf"))

    base = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "gradient_accumulation_steps": 1}
    checked = dsplug_run({**base, "bf16": {"enabled": True, "check_grad_overflow": True}}, 3, optimizer=sgd,
                         inject=inject)
    assert checked["skipped"] == 1 and all(torch.isfinite(p).all() for p in checked["params"])
    unchecked = dsplug_run({**base, "bf16": {"enabled": True}}, 3, optimizer=sgd, inject=inject)
    assert unchecked["skipped"] == 0 and not all(torch.isfinite(p).all() for p in unchecked["params"])


def test_amp_dynamic_scale_is_capped_by_max_loss_scale():
    from dsplug.plugins.precision.loss_scaler import DynamicScaler

    s = DynamicScaler(initial_scale_power=3, scale_window=1, max_scale=32.0)
    for _ in range(5):
        s.update(False)
    assert s.scale == 32.0


class _Counter:
    """An observer plugin with state that must survive a checkpoint."""

    def __init__(self):
        self.steps = 0
        self.restored = None

    @dsplug.hookimpl
    def dsplug_step_end(self, engine, metrics):
        self.steps += 1

    @dsplug.hookimpl
    def dsplug_checkpoint_state(self, engine, scope):
        return {"counter.steps": self.steps} if scope == "model" else {"counter.rank": engine.global_rank}

    @dsplug.hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        self.restored = (checkpoint.model["counter.steps"], checkpoint.rank["counter.rank"])


def test_observer_state_is_saved_and_handed_back(tmp_path):
    from dsplug.engine import Engine
    from dsplug.registry import Registry

    registry = Registry()
    counter = _Counter()
    registry.register(counter, distribution="test-observer")
    engine = Engine(make_model(), {"train_batch_size": 4}, optimizer=sgd, registry=registry)
    x = torch.randn(4, 12)
    for _ in range(3):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(tmp_path)
    Engine(make_model(), {"train_batch_size": 4}, optimizer=sgd, registry=registry).load_checkpoint(tmp_path)
    assert counter.restored == (3, 0)


class _Clash:
    @dsplug.hookimpl
    def dsplug_checkpoint_state(self, scope):
        return {"module": "mine"} if scope == "model" else None


class _Raising:
    @dsplug.hookimpl
    def dsplug_step_end(self, metrics):
        raise ZeroDivisionError("bad observer")


def test_checkpoint_key_clash_and_raising_hook_name_the_plugin(tmp_path):
    from dsplug import checkpoint as ckpt
    from dsplug.engine import Engine
    from dsplug.events import PluginHookError
    from dsplug.registry import Registry

    registry = Registry()
    registry.register(_Clash(), distribution="clashing-dist")
    engine = Engine(make_model(), {"train_batch_size": 4}, optimizer=sgd, registry=registry)
    with pytest.raises(ckpt.CheckpointError, match=r"key 'module' .* contributed by .*DataParallelStage.* and by plugin 'clashing-dist"):
        engine.save_checkpoint(tmp_path)
    registry = Registry()
    registry.register(_Raising(), distribution="raising-dist")
    engine = Engine(make_model(), {"train_batch_size": 4}, optimizer=sgd, registry=registry)
    engine.backward(engine(torch.randn(4, 12)).pow(2).mean())
    with pytest.raises(PluginHookError, match=r"plugin 'raising-dist:.*' raised in dsplug_step_end: "
                                              r"ZeroDivisionError: bad observer"):
        engine.step()


def _save_fails_on_rank_one(save_dir):
    from dsplug import checkpoint as ckpt
    from dsplug import comm

    engine, _, _, _ = dsplug.initialize(model=make_model(), optimizer=sgd, config={"train_batch_size": 8})
    engine.save_checkpoint(save_dir, tag="good")
    if comm.get_rank() == 1:
        def full_disk(obj, path):
            raise OSError(28, "No space left on device", path)
        ckpt.atomic_save = full_disk
    try:
        engine.save_checkpoint(save_dir, tag="bad")
    except Exception as exc:  # noqa: BLE001 - the test inspects what each rank saw
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.multiprocess
def test_a_save_failing_on_one_rank_fails_everywhere_and_keeps_the_previous(tmp_path):
    outcomes = run_distributed(_save_fails_on_rank_one, 2, str(tmp_path), timeout=120)
    assert outcomes[0].startswith("CheckpointError: checkpoint writing failed on rank 1: OSError")
    assert outcomes[1].startswith("OSError") and "No space left on device" in outcomes[1]
    assert (tmp_path / "latest").read_text() == "good" and not (tmp_path / "bad").exists()
