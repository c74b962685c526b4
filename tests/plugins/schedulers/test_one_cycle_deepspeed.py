"""OneCycle under dsplug.initialize against DeepSpeed 0.19.8's own numbers
(tests/data/deepspeed/one_cycle.json, made by tests/data/deepspeed/make_one_cycle.py in a separate
DeepSpeed environment): the lr and Adam's betas after initialize and after every step, and the
losses, on the same model, data and config."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

import dsplug

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "deepspeed"
FIXTURE = json.loads((DATA / "one_cycle.json").read_text())
sys.path.insert(0, str(DATA))
try:
    import make_one_cycle as M
finally:
    sys.path.remove(str(DATA))


@pytest.fixture(scope="module")
def runs():
    return {name: M.run(dsplug.initialize, name) for name in M.CASES}


def same_steps(ours, theirs):
    """lr and momentum after initialize, those each optimizer step ran with, and after each step."""
    assert ours["initial"]["lr"] == pytest.approx(theirs["initial"]["lr"], rel=1e-12)
    assert ours["initial"]["momentum"] == pytest.approx(theirs["initial"]["momentum"], rel=1e-12)
    for what in ("used", "steps"):
        assert len(ours[what]) == len(theirs[what])
        for step, (mine, ref) in enumerate(zip(ours[what], theirs[what]), start=1):
            assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-12), (what, step)
            assert mine["momentum"] == pytest.approx(ref["momentum"], rel=1e-12), (what, step)


def test_the_fixture_comes_from_deepspeed_0_19_8():
    assert FIXTURE["deepspeed"] == "0.19.8" and set(FIXTURE["cases"]) == set(M.CASES)
    # the documented config: DeepSpeed's loss after 3 steps
    assert FIXTURE["cases"]["documented_adam"]["losses"][2] == pytest.approx(3.0972209, abs=1e-6)


def test_documented_config_starts_adam_at_cycle_min_mom_and_beta2_0_99(runs):
    """DeepSpeed's documented OneCycle example: betas (cycle_min_mom, 0.99) = (0.85, 0.99) from
    initialize on, so the first step already uses them, and the loss after 3 steps is DeepSpeed's."""
    ours, theirs = runs["documented_adam"], FIXTURE["cases"]["documented_adam"]
    assert ours["initial"] == theirs["initial"] == {"lr": 0.0001, "momentum": [0.85, 0.99]}
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=2e-6)


@pytest.mark.parametrize("name", ["documented_adam", "short_adam", "short_adam_no_momentum"])
def test_adam_lr_betas_and_losses_equal_deepspeeds_every_step(runs, name):
    ours, theirs = runs[name], FIXTURE["cases"][name]
    same_steps(ours, theirs)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=2e-6)


def test_without_deepspeeds_start_the_loss_would_differ():
    """The difference this fixes: betas (cycle_max_mom, configured beta2) before the first step, as
    dsplug had, give another loss after 3 steps than DeepSpeed's (cycle_min_mom, 0.99)."""
    from dsplug.plugins.schedulers import one_cycle

    class OldStart(one_cycle.OneCycle):
        def _apply(self):
            one_cycle.LRSchedule._apply(self)
            one_cycle.write_momenta(self.optimizer.param_groups, self.momentum_at(self.last_batch_iteration))

    original = one_cycle.OneCycle
    try:
        one_cycle.OneCycle = OldStart
        old = M.run(dsplug.initialize, "documented_adam")
    finally:
        one_cycle.OneCycle = original
    theirs = FIXTURE["cases"]["documented_adam"]
    assert old["initial"]["momentum"] == [0.99, 0.999]
    assert abs(old["losses"][2] - theirs["losses"][2]) > 1e-5


@pytest.mark.xfail(strict=True, reason="DeepSpeed 0.19.8 clips gradients at 1.0 when the config has no "
                   "gradient_clipping (its GRADIENT_CLIPPING_DEFAULT; its legacy docs say 0); dsplug's default is 0 "
                   "(core/config/kernel_schema.py): a kernel decision, reported, not made here")
def test_default_gradient_clipping_is_deepspeeds(runs):
    ours, theirs = runs["documented_adam_default_clipping"], FIXTURE["cases"]["documented_adam_default_clipping"]
    same_steps(ours, theirs)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=2e-6)


def test_sgd_lr_equals_deepspeeds_and_its_momentum_is_a_dsplug_extension(runs):
    """DeepSpeed's OneCycle leaves an optimizer without betas alone (lr-only); dsplug cycles SGD's
    momentum too (documented in plugins/schedulers/one_cycle.py), so only the lr is compared."""
    ours, theirs = runs["short_sgd"], FIXTURE["cases"]["short_sgd"]
    assert [s["lr"] for s in ours["steps"]] == pytest.approx([s["lr"] for s in theirs["steps"]], rel=1e-12)
    assert {s["momentum"] for s in theirs["steps"]} == {0.9}
    assert ours["steps"][3]["momentum"] == pytest.approx(M.SHORT["cycle_min_mom"])  # the lr peak
