"""``engine.optimizer`` has DeepSpeed's shape: the base optimizer where DeepSpeed hands it back
unwrapped (stage 0 in fp32 or torch amp), a wrapper whose ``.optimizer`` is the base where DeepSpeed
wraps it (ZeRO stages 1-3, fp16, bf16)."""
from __future__ import annotations

import pytest
import torch

import dsplug
from dsplug.optimizer_view import WrappedOptimizer
from tests.engine_common import IN, make_model

pytestmark = pytest.mark.quick


def _engine(stage=0, precision=None, optimizer=None, **extra):
    config = {"train_batch_size": 4, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              **extra}
    if optimizer is None:
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    if precision:
        config[precision] = {"enabled": True}
    engine, opt, _, _ = dsplug.initialize(model=make_model(), config=config, optimizer=optimizer)
    assert opt is engine.optimizer
    return engine


@pytest.mark.parametrize("stage, precision", [(0, None), (0, "amp")])
def test_unwrapped_where_deepspeed_does_not_wrap(stage, precision):
    if precision == "amp":
        engine = _engine(stage, None, amp={"enabled": True, "dtype": "bf16"})
    else:
        engine = _engine(stage, precision)
    assert isinstance(engine.optimizer, torch.optim.SGD) and engine.optimizer is engine.basic_optimizer


@pytest.mark.parametrize("stage, precision", [(1, None), (2, None), (3, None), (0, "bf16"), (0, "fp16"), (2, "bf16")])
def test_wrapped_where_deepspeed_wraps(stage, precision):
    engine = _engine(stage, precision)
    view = engine.optimizer
    assert isinstance(view, WrappedOptimizer) and isinstance(view, torch.optim.Optimizer)
    assert view.optimizer is engine.basic_optimizer and isinstance(view.optimizer, torch.optim.SGD)
    assert view.param_groups is view.optimizer.param_groups and view.state is view.optimizer.state
    assert view.defaults is view.optimizer.defaults and view.state_dict() == view.optimizer.state_dict()
    assert view.loss_scale == engine.get_loss_scale() == view.cur_scale
    # other attributes are the base's
    assert view._optimizer_step_pre_hooks is view.optimizer._optimizer_step_pre_hooks
    with pytest.raises(AttributeError, match="no_such_attribute"):
        view.no_such_attribute


def test_the_view_writes_through_to_the_base_and_training_sees_it():
    """An lr set through engine.optimizer is the lr the stage steps with; a new attribute lands on
    the base; ``overflow`` is the view's own."""
    engine = _engine(2)
    view, base = engine.optimizer, engine.basic_optimizer
    for group in view.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(torch.randn(4, IN)).pow(2).mean())
    engine.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, engine.module.parameters()))
    view.custom_flag = 7
    assert base.custom_flag == 7
    assert view.overflow is False and "overflow" not in vars(base)


def test_overflow_reports_a_skipped_fp16_step():
    """DeepSpeed's fp16 wrapper says ``overflow`` after a skipped step (Accelerate's
    ``step_was_skipped`` reads it)."""
    engine = _engine(0, None, fp16={"enabled": True, "initial_scale_power": 4})
    engine.backward(engine(torch.full((4, IN), float("inf"), dtype=torch.half)).sum())
    engine.step()
    assert engine.optimizer.overflow is True and not engine.was_step_applied()
    engine.backward(engine(torch.randn(4, IN, dtype=torch.half)).float().pow(2).mean())
    engine.step()
    assert engine.optimizer.overflow is False and engine.was_step_applied()


def test_an_lr_scheduler_callable_gets_the_base_optimizer():
    """As in DeepSpeed: a torch scheduler needs a torch.optim.Optimizer, so the callable is given
    the optimizer under the wrapper, and the schedule drives what trains."""
    seen = []

    def scheduler(optimizer):
        seen.append(optimizer)
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    config = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, opt, _, sched = dsplug.initialize(model=make_model(), config=config, lr_scheduler=scheduler)
    assert seen == [engine.basic_optimizer] and sched.optimizer is opt.optimizer
    engine.backward(engine(torch.randn(4, IN)).pow(2).mean())
    engine.step()
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.05)] == engine.get_lr()


def test_stage3_grad_partitions_under_optimizer_offload_are_fp32():
    """DeepSpeed's ZeRO-3 gradient partitions are fp32 (bf16 training, offloaded here); at one rank
    each is the whole gradient, accumulated over micro-steps until the step clears them."""
    from dsplug.utils import safe_get_full_grad

    config = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    engine, opt, _, _ = dsplug.initialize(model=make_model(), config=config)
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    first = {i: t.clone() for i, t in opt.get_fp32_grad_partitions()[0].items()}
    engine.step()  # inside the window: nothing is applied, the partitions accumulate
    engine.backward(engine(x).float().pow(2).mean())
    parts = opt.get_fp32_grad_partitions()
    params = list(engine.module.parameters())
    assert set(parts) == {0} and set(parts[0]) == set(range(len(params)))
    for i, p in enumerate(params):
        assert parts[0][i].dtype == torch.float32
        assert torch.equal(parts[0][i], safe_get_full_grad(p).reshape(-1).float())
        torch.testing.assert_close(parts[0][i], 2 * first[i], rtol=1e-2, atol=1e-3)  # the same micro-batch twice
    assert all(torch.equal(a, parts[0][i]) for i, a in enumerate(opt.averaged_gradients[0]))
    engine.step()
    assert all(not t.any() for t in opt.get_fp32_grad_partitions()[0].values())


def test_allreduce_gradients_returns_where_backward_reduced_and_refuses_inside_a_window():
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}}
    engine, *_ = dsplug.initialize(model=make_model(), config=config)
    engine.backward(engine(torch.randn(4, IN)).pow(2).mean())
    with pytest.raises(RuntimeError, match="inside an accumulation window, and ZeRO stage 1 reduces"):
        engine.allreduce_gradients()
    engine.step()
    engine.backward(engine(torch.randn(4, IN)).pow(2).mean())
    engine.allreduce_gradients()  # the boundary's backward reduced them
    stage3 = _engine(3)
    stage3.backward(stage3(torch.randn(4, IN)).pow(2).mean())
    stage3.allreduce_gradients()  # stage 3 reduces every micro-step


def test_a_torch_scheduler_built_on_engine_optimizer_drives_what_trains():
    """Built after initialize() on the view (torch wraps its ``step``): the schedule sets the base
    optimizer's lr, and stepping goes through without recursion."""
    engine = _engine(2)
    view = engine.optimizer
    sched = torch.optim.lr_scheduler.StepLR(view, step_size=1, gamma=0.5)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, IN)).pow(2).mean())
        view.step()  # the stage's update, through torch's wrapper of step (no recursion)
        view.zero_grad()
        sched.step()
    assert engine.basic_optimizer.param_groups[0]["lr"] == pytest.approx(0.025) == engine.get_lr()[0]
    assert "step" not in vars(engine.basic_optimizer)  # torch's wrapper stayed on the view
    handle = view.register_step_post_hook(lambda opt, args, kwargs: None)  # torch's hooks: the base's
    assert handle.id in engine.basic_optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize("stage", [2, 3])
def test_the_views_step_and_zero_grad_are_the_stages(stage):
    """As DeepSpeed's wrappers: ``engine.optimizer.step()`` is the stage's whole update (the same
    weights as engine.step()), ``_global_grad_norm`` its norm, ``zero_grad()`` drops the gradients
    the stage holds; the engine's counters are engine.step()'s alone."""
    torch.manual_seed(0)
    batches = [torch.randn(4, IN) for _ in range(3)]
    by_engine, by_view = _engine(stage, gradient_clipping=0.5), _engine(stage, gradient_clipping=0.5)
    for x in batches:
        by_engine.backward(by_engine(x).pow(2).mean())
        by_engine.step()
        by_view.backward(by_view(x).pow(2).mean())
        by_view.optimizer.step()
        assert by_view.optimizer._global_grad_norm == pytest.approx(by_engine.get_global_grad_norm())
        by_view.optimizer.zero_grad()
    from dsplug.utils import safe_get_full_fp32_param

    for a, b in zip(by_engine.module.parameters(), by_view.module.parameters()):
        assert torch.equal(safe_get_full_fp32_param(a), safe_get_full_fp32_param(b))
    assert by_view.global_steps == 0 and by_engine.global_steps == 3
    by_view.backward(by_view(batches[0]).pow(2).mean())
    by_view.optimizer.zero_grad()
    if stage == 3:
        assert not any(t.any() for t in by_view.optimizer.get_fp32_grad_partitions()[0].values())
