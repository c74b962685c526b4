"""The built-in LR schedulers against closed-form schedules written out here, independently.

Convention checked throughout: ``t`` is ``last_batch_iteration`` after ``t + 1`` calls of
``step()``; the value before the first ``step()`` is the one for ``t = -1``.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsplug.config.schema import ConfigError, parse
from dsplug.plugins.schedulers.lr_range_test import LRRangeTest, LRRangeTestParams
from dsplug.plugins.schedulers.one_cycle import OneCycle, OneCycleParams
from dsplug.plugins.schedulers.warmup import WarmupDecayLR, WarmupDecayLRParams, WarmupLR, WarmupLRParams
from dsplug.plugins.schedulers.warmup_cosine import WarmupCosineLR, WarmupCosineLRParams
from dsplug.registry import get_registry


def sgd(lr=0.5, momentum=0.9, groups=1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def adam(lr=0.5, groups=1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=lr, betas=(0.95, 0.999))


def trace(scheduler, optimizer, steps):
    """lr (and momentum) the optimizer holds after each of ``steps`` calls of step(), keyed by t."""
    out = {}
    for t in range(steps):
        scheduler.step()
        group = optimizer.param_groups[0]
        momentum = group["betas"][0] if "betas" in group else group.get("momentum")
        out[t] = (group["lr"], momentum)
        assert scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
    return out


# ------------------------------------------------------------------------------ WarmupLR
def ref_warmup_gamma(t, n, kind):
    if t >= n:
        return 1.0
    return math.log(t + 1) / math.log(n) if kind == "log" else t / n


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_closed_form(kind):
    lo, hi, n = 0.01, 0.1, 10
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n, warmup_type=kind)
    assert opt.param_groups[0]["lr"] == pytest.approx(lo)  # before the first step
    lrs = trace(sched, opt, 20)
    for t in (0, 1, 3, 5, 9, 10, 15, 19):
        assert lrs[t][0] == pytest.approx(lo + (hi - lo) * ref_warmup_gamma(t, n, kind), rel=1e-12), t
    assert lrs[n - 1][0] == pytest.approx(hi if kind == "log" else lo + (hi - lo) * 0.9)
    assert lrs[19][0] == pytest.approx(hi)


def test_warmup_lr_defaults_and_short_warmup():
    opt = sgd()
    sched = WarmupLR(opt)  # DeepSpeed 0.19.8's defaults: 0 -> the group's lr (0.5) over 1000 steps, log
    sched.step(last_batch_iteration=99)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * math.log(100) / math.log(1000))
    # warmup_num_steps below 2 counts as 2 (as in DeepSpeed)
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=0, warmup_type="linear")
    assert [v[0] for v in trace(sched, opt, 3).values()] == pytest.approx([0.0, 0.5, 1.0])


def test_warmup_lr_per_group_values():
    opt = sgd(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4, warmup_type="linear")
    sched.step(last_batch_iteration=2)
    assert sched.get_last_lr() == pytest.approx([0.5, 0.15])
    with pytest.raises(ValueError, match=r"warmup_max_lr has 3 values but the optimizer has 2 parameter group"):
        WarmupLR(sgd(groups=2), warmup_max_lr=[1.0, 2.0, 3.0])


# ------------------------------------------------------------------------- WarmupDecayLR
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_matches_closed_form(kind):
    lo, hi, n, total = 0.0, 0.2, 10, 30
    opt = adam()
    sched = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                          warmup_num_steps=n, warmup_type=kind)
    lrs = trace(sched, opt, 40)

    def expected(t):
        if t < n:
            return lo + (hi - lo) * ref_warmup_gamma(t, n, kind)
        return lo + (hi - lo) * max(0.0, (total - t) / (total - n))

    for t in (0, 4, 9, 10, 11, 20, 29, 30, 35, 39):
        assert lrs[t][0] == pytest.approx(expected(t), rel=1e-12, abs=1e-15), t
    assert lrs[n][0] == pytest.approx(hi)  # peak right after the warmup
    assert lrs[20][0] == pytest.approx(hi / 2)  # halfway down
    assert lrs[total][0] == 0.0 and lrs[39][0] == 0.0  # reaches warmup_min_lr and stays


def test_warmup_decay_lr_decays_to_warmup_min_lr():
    opt = sgd()
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_min_lr=0.05, warmup_max_lr=0.15, warmup_num_steps=10)
    sched.step(last_batch_iteration=25)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


# ------------------------------------------------------------------------ WarmupCosineLR
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_closed_form(kind):
    base, n, total, w, c = 0.4, 10, 50, 0.1, 0.01
    opt = sgd(lr=base)
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=w, warmup_num_steps=n,
                           cos_min_ratio=c, warmup_type=kind)
    assert opt.param_groups[0]["lr"] == pytest.approx(base * w)  # before the first step
    lrs = trace(sched, opt, 60)

    def expected(t):
        if t < n:
            return base * (w + (1 - w) * ref_warmup_gamma(t, n, kind))
        progress = min(1.0, (t - n + 1) / (total - n))
        return base * (c + (1 - c) * 0.5 * (1 + math.cos(math.pi * progress)))

    for t in (0, 3, 9, 10, 20, 29, 48, 49, 55, 59):
        assert lrs[t][0] == pytest.approx(expected(t), rel=1e-12), t
    assert lrs[total - 1][0] == pytest.approx(base * c)  # the last step of the run is at the floor
    assert lrs[59][0] == pytest.approx(base * c)  # and it stays there (no cosine rebound)
    assert lrs[n - 1 + 20][0] == pytest.approx(base * (c + (1 - c) * 0.5))  # midpoint of the cosine


# ------------------------------------------------------------------------------ OneCycle
def ref_one_cycle(p, s1, s2, n1=0, n2=0):
    """Scale s at batch position p of a cycle of s1 rising and s2 falling batches."""
    if p <= s1:
        return math.floor(p * n1 / s1) / n1 if n1 else p / s1
    return math.floor((s1 + s2 - p) * n2 / s2) / n2 if n2 else (s1 + s2 - p) / s2


@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd-momentum", "adam-betas"])
def test_one_cycle_lr_and_momentum_cycle_then_decay(make_opt):
    lo, hi, mlo, mhi, s1, s2, dss, lr_rate, mom_rate = 0.01, 0.1, 0.85, 0.95, 10, 20, 5, 0.5, 0.01
    opt = make_opt()
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, decay_lr_rate=lr_rate, cycle_first_step_size=s1,
                     cycle_second_step_size=s2, decay_step_size=dss, cycle_min_mom=mlo, cycle_max_mom=mhi,
                     decay_mom_rate=mom_rate)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(lo)
    # before the first step the optimizer holds the lowest momentum (DeepSpeed's start), while
    # get_mom() reports the formula's value at p = 0, in DeepSpeed's shape: (beta1, 0.99) per group
    assert (group["betas"][0] if "betas" in group else group["momentum"]) == pytest.approx(mlo)
    assert len(sched.get_mom()) == 1 and sched.get_mom()[0] == pytest.approx((mhi, 0.99))
    got = trace(sched, opt, 45)
    for t in (0, 4, 8, 9, 10, 19, 28, 29, 30, 34, 44):
        p = t + 1
        if p <= s1 + s2:
            s = ref_one_cycle(p, s1, s2)
            lr, mom = lo + (hi - lo) * s, mhi - (mhi - mlo) * s
        else:
            d = (p - s1 - s2) / dss
            lr, mom = lo / (1 + lr_rate * d), mhi * (1 + mom_rate * d)
        assert got[t][0] == pytest.approx(lr, rel=1e-12), t
        assert got[t][1] == pytest.approx(mom, rel=1e-12), t
    assert got[s1 - 1] == pytest.approx((hi, mlo))  # peak lr, lowest momentum
    assert got[s1 + s2 - 1] == pytest.approx((lo, mhi))  # back at the start
    # get_mom(): what the optimizer holds now, as DeepSpeed's (momentum, 0.99) pair per group
    assert len(sched.get_mom()) == 1 and sched.get_mom()[0] == pytest.approx((got[44][1], 0.99))
    if "betas" in group:
        assert group["betas"][1] == 0.99  # beta2 is DeepSpeed's 0.99 while betas[0] cycles


def test_one_cycle_staircase():
    lo, hi = 0.0, 1.0
    opt = sgd()
    sched = OneCycle(opt, lo, hi, cycle_first_step_size=8, cycle_second_step_size=8,
                     cycle_first_stair_count=4, cycle_second_stair_count=2, cycle_momentum=False)
    got = [v[0] for v in trace(sched, opt, 18).values()]  # got[p - 1] is the lr at position p
    # rising: 4 stairs of 2 batches; falling: 2 stairs of 4 batches; then no decay (decay_step_size 0)
    assert got == pytest.approx([0, .25, .25, .5, .5, .75, .75, 1.0, .5, .5, .5, .5, 0, 0, 0, 0, 0, 0])
    assert got == pytest.approx([ref_one_cycle(p, 8, 8, 4, 2) for p in range(1, 17)] + [0, 0])
    assert opt.param_groups[0]["momentum"] == 0.9  # cycle_momentum=False leaves momentum alone


def test_one_cycle_second_stair_count_defaults_to_first():
    opt = sgd()
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2, cycle_momentum=False)
    got = [v[0] for v in trace(sched, opt, 8).values()]
    assert got == pytest.approx([0, .5, .5, 1.0, .5, .5, 0, 0])


def test_one_cycle_without_momentum_warns_and_cycles_lr_only():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.3)
    with pytest.warns(UserWarning, match="cycle_momentum is disabled because Adagrad"):
        sched = OneCycle(opt, 0.1, 0.2, cycle_first_step_size=2)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.15)
    assert sched.get_mom() is None


# --------------------------------------------------------------------------- LRRangeTest
@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_matches_closed_form(staircase):
    mins, size, rate = [1e-3, 2e-3], 5, 2.0
    opt = sgd(groups=2)
    sched = LRRangeTest(opt, lr_range_test_min_lr=mins, lr_range_test_step_size=size,
                        lr_range_test_step_rate=rate, lr_range_test_staircase=staircase)
    assert sched.get_last_lr() == pytest.approx(mins)
    for t in range(23):
        sched.step()
        k = math.floor((t + 1) / size) if staircase else (t + 1) / size
        assert sched.get_last_lr() == pytest.approx([m * (1 + rate * k) for m in mins], rel=1e-12), t
    if staircase:  # held flat within a stair
        sched.step(last_batch_iteration=5)
        flat = sched.get_last_lr()
        sched.step(last_batch_iteration=8)
        assert sched.get_last_lr() == flat


# ------------------------------------------------------------------ state and iteration
SCHEDULES = {
    "WarmupLR": (WarmupLR, dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=7)),
    "WarmupDecayLR": (WarmupDecayLR, dict(total_num_steps=15, warmup_num_steps=5, warmup_type="linear")),
    "WarmupCosineLR": (WarmupCosineLR, dict(total_num_steps=15, warmup_num_steps=4, warmup_min_ratio=0.2)),
    "OneCycle": (OneCycle, dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                                cycle_second_step_size=6, decay_step_size=2, decay_lr_rate=0.3,
                                decay_mom_rate=0.02, cycle_first_stair_count=2)),
    "LRRangeTest": (LRRangeTest, dict(lr_range_test_step_size=3, lr_range_test_staircase=True)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("make_opt", [sgd, adam], ids=["sgd", "adam"])
def test_state_dict_resume_is_exact(name, make_opt):
    cls, kwargs = SCHEDULES[name]
    k, m = 6, 14
    opt = make_opt(lr=0.3)
    full = trace(cls(opt, **kwargs), opt, k + m)

    opt = make_opt(lr=0.3)
    first = cls(opt, **kwargs)
    trace(first, opt, k)
    saved = json.loads(json.dumps(first.state_dict()))  # checkpoints must survive a plain-JSON trip
    assert saved["last_batch_iteration"] == k - 1

    fresh_opt = make_opt(lr=0.3)
    resumed = cls(fresh_opt, **kwargs)
    fresh_opt.param_groups[0]["lr"] = 123.0  # whatever the optimizer holds, loading restores the schedule
    resumed.load_state_dict(saved)
    assert fresh_opt.param_groups[0]["lr"] == full[k - 1][0]
    rest = trace(resumed, fresh_opt, m)
    assert [rest[i] for i in range(m)] == [full[k + i] for i in range(m)]


def test_warmup_cosine_resume_keeps_base_lr_from_the_checkpoint():
    opt = sgd(lr=0.3)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=4)
    trace(sched, opt, 5)
    state = sched.state_dict()
    # the resumed optimizer comes back with the scheduled lr, not the configured one
    resumed_opt = sgd(lr=opt.param_groups[0]["lr"])
    resumed = WarmupCosineLR(resumed_opt, total_num_steps=20, warmup_num_steps=4)
    resumed.load_state_dict(state)
    resumed.step()
    sched.step()
    assert resumed.get_last_lr() == sched.get_last_lr()


def test_deepspeed_format_state_dict_and_bad_state():
    opt = sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    sched.load_state_dict({"last_batch_iteration": 4})  # what DeepSpeed saves
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="expected a dict with key 'last_batch_iteration'"):
        sched.load_state_dict({"epoch": 3})


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_step_to_an_iteration_equals_stepping_there(name):
    cls, kwargs = SCHEDULES[name]
    opt_a, opt_b = sgd(), sgd()
    a, b = cls(opt_a, **kwargs), cls(opt_b, **kwargs)
    for _ in range(9):
        a.step()
    b.step(8)
    assert a.get_last_lr() == b.get_last_lr() and a.last_batch_iteration == b.last_batch_iteration == 8
    b.step(batch_iteration=3)  # DeepSpeed's keyword for OneCycle / LRRangeTest
    a.step(last_batch_iteration=3)
    assert a.get_last_lr() == b.get_last_lr() == a.get_lr()


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 60), first=st.integers(1, 12), second=st.integers(1, 12), stairs=st.integers(0, 4))
def test_one_cycle_resume_property(k, first, second, stairs):
    kwargs = dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=first, cycle_second_step_size=second,
                  cycle_first_stair_count=stairs, decay_step_size=3, decay_lr_rate=0.1)
    opt = adam()
    sched = OneCycle(opt, **kwargs)
    for _ in range(k + 1):
        sched.step()
    lrs, mom = sched.get_last_lr(), sched.get_mom()
    assert 0.01 * (1 - 1e-12) <= lrs[0] or k + 1 > first + second
    assert lrs[0] <= 0.1 * (1 + 1e-12)
    resumed = OneCycle(adam(), **kwargs)
    resumed.load_state_dict(sched.state_dict())
    assert (resumed.get_last_lr(), resumed.get_mom()) == (lrs, mom)


def test_tensor_lr_is_updated_in_place():
    lr = torch.tensor(0.01)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, foreach=False)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    sched.step(2)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------ schemas
def errors_of(schema_cls, params):
    with pytest.raises(ConfigError) as info:
        parse(schema_cls, params, "scheduler.params")
    return str(info.value)


def test_schema_defaults_match_deepspeed():
    assert parse(WarmupLRParams, {}) == WarmupLRParams(
        warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log", last_batch_iteration=-1)
    cos = parse(WarmupCosineLRParams, {"total_num_steps": 5000})
    assert (cos.warmup_min_ratio, cos.warmup_num_steps, cos.cos_min_ratio, cos.warmup_type) == (0.0, 1000, 0.0001, "log")
    one = parse(OneCycleParams, {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01})
    assert (one.decay_lr_rate, one.cycle_first_step_size, one.cycle_second_step_size, one.cycle_first_stair_count,
            one.cycle_second_stair_count, one.decay_step_size, one.cycle_momentum, one.cycle_min_mom,
            one.cycle_max_mom, one.decay_mom_rate) == (0.0, 2000, None, 0, None, 0, True, 0.8, 0.9, 0.0)
    rt = parse(LRRangeTestParams, {})
    assert (rt.lr_range_test_min_lr, rt.lr_range_test_step_size, rt.lr_range_test_step_rate,
            rt.lr_range_test_staircase) == (1e-3, 2000, 1.0, False)


def test_schema_unknown_key_suggests_the_right_one():
    text = errors_of(WarmupLRParams, {"warmup_max_lrr": 0.1})
    assert "scheduler.params.warmup_max_lrr" in text and "did you mean 'scheduler.params.warmup_max_lr'" in text


def test_schema_wrong_type_and_bad_values():
    text = errors_of(WarmupLRParams, {"warmup_num_steps": "ten", "warmup_type": "cosine", "warmup_min_lr": -1.0})
    assert "scheduler.params.warmup_num_steps: 'ten' is not valid: expected an integer" in text
    assert "scheduler.params.warmup_type: 'cosine' is not valid" in text and "'log', 'linear'" in text
    assert "scheduler.params.warmup_min_lr" in text and "must be >= 0" in text
    text = errors_of(OneCycleParams, {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_max_mom": 1.5,
                                      "cycle_momentum": "yes", "cycle_first_step_size": 0})
    assert "scheduler.params.cycle_max_mom: 1.5 is not valid: momentum must be in [0, 1)" in text
    assert "scheduler.params.cycle_momentum: 'yes' is not valid: expected a boolean" in text
    assert "scheduler.params.cycle_first_step_size: 0 is not valid: must be >= 1" in text
    assert "cycle_min_lr" in errors_of(OneCycleParams, {"cycle_max_lr": 1.0})  # required
    assert "lr_range_test_staircase" in errors_of(LRRangeTestParams, {"lr_range_test_staircase": 2})


def test_schema_cross_field_rules_name_keys_and_values():
    text = errors_of(WarmupDecayLRParams, {"total_num_steps": 100, "warmup_num_steps": 500})
    assert "scheduler.params.total_num_steps: total_num_steps (100) must be >= warmup_num_steps (500)" in text
    text = errors_of(WarmupCosineLRParams, {"total_num_steps": 100})  # the default warmup is 1000 steps
    assert "total_num_steps (100) must be >= warmup_num_steps (1000)" in text
    text = errors_of(OneCycleParams, {"cycle_min_lr": 0.5, "cycle_max_lr": 0.1})
    assert "cycle_min_lr (0.5) must be <= cycle_max_lr (0.1)" in text
    text = errors_of(OneCycleParams, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_min_mom": 0.95})
    assert "cycle_min_mom (0.95) must be <= cycle_max_mom (0.9)" in text
    # the same rule guards direct construction (e.g. after "auto" values are resolved)
    with pytest.raises(ValueError, match=r"total_num_steps \(10\) must be >= warmup_num_steps \(20\)"):
        WarmupDecayLR(sgd(), total_num_steps=10, warmup_num_steps=20)


def test_schema_auto_values():
    params = {"total_num_steps": "auto", "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    parsed = parse(WarmupDecayLRParams, params, "scheduler.params")
    assert (parsed.total_num_steps, parsed.warmup_max_lr) == ("auto", "auto")
    text = errors_of(WarmupLRParams, {"warmup_type": "auto"})
    assert 'scheduler.params.warmup_type: "auto" is not accepted here' in text


# --------------------------------------------------------------------- registry / factory
@pytest.mark.parametrize("name, cls", [
    ("warmuplr", WarmupLR), ("WARMUPDECAYLR", WarmupDecayLR), ("WarmupCosineLR", WarmupCosineLR),
    ("onecycle", OneCycle), ("1Cycle", OneCycle), ("1cycle", OneCycle), ("lrrangetest", LRRangeTest),
])
def test_registry_selects_scheduler_by_name(name, cls):
    provided = get_registry(refresh=True).get("scheduler", name)
    assert provided.distribution == "dsplug"
    params = {"total_num_steps": 100, "warmup_num_steps": 10} if "decay" in name.lower() or "cosine" in name.lower() else {}
    if cls is OneCycle:
        params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}
    config = parse(provided.spec.schema, params, "scheduler.params")
    opt = sgd()
    sched = provided.spec.factory(opt, config, None)
    assert type(sched) is cls
    sched.step()
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_registry_miss_suggests_a_name():
    with pytest.raises(LookupError, match="Did you mean 'WarmupLR'"):
        get_registry().get("scheduler", "warmuplrr", what="scheduler.type")


def test_factory_rejects_unresolved_auto():
    spec = get_registry().get("scheduler", "WarmupLR").spec
    config = parse(spec.schema, {"warmup_max_lr": "auto"}, "scheduler.params")
    with pytest.raises(ConfigError, match=r'scheduler.params.warmup_max_lr: "auto" was not resolved'):
        spec.factory(sgd(), config, None)


def test_compat_import_path_and_cheap_import():
    from dsplug.runtime import lr_schedules

    assert lr_schedules.WarmupLR is WarmupLR and lr_schedules.OneCycle is OneCycle
    assert set(lr_schedules.VALID_LR_SCHEDULES) == {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    code = ("import sys, dsplug.runtime.lr_schedules, dsplug.plugins.schedulers.one_cycle; "
            "print('torch' in sys.modules)")
    # importing the path discovers every installed plugin; no entry-point module imports torch
    env = {k: v for k, v in os.environ.items() if k != "DSPLUG_BLOCK_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"


def test_warmup_lr_class_without_max_lr_warms_each_group_up_to_its_own_lr():
    """DeepSpeed's WarmupLR(optimizer) without warmup_max_lr: every group's own lr is its target."""
    from dsplug.plugins.schedulers.warmup import WarmupLR

    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    sched = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2]
    sched.step(5)
    assert sched.get_lr() == pytest.approx([0.05, 0.1])
    sched.step(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])


def test_one_cycle_with_a_zero_second_half_drops_back_after_the_peak():
    from dsplug.plugins.schedulers.one_cycle import OneCycle

    p = torch.nn.Parameter(torch.zeros(1))
    sched = OneCycle(torch.optim.SGD([p], lr=0.1, momentum=0.9), cycle_min_lr=0.001, cycle_max_lr=0.1,
                     cycle_first_step_size=4, cycle_second_step_size=0, cycle_momentum=False)
    assert sched.step_ratio == 1.0
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_lr()[0])
        sched.step()
    # rises linearly over 4 batches to the peak, then the decay phase starts from cycle_min_lr
    assert lrs[:5] == pytest.approx([0.001 + (0.1 - 0.001) * k / 4 for k in range(5)])
    assert lrs[5] == pytest.approx(0.001)
