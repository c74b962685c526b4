"""Partitioned ZeRO checkpoints: offline consolidation (zero-to-fp32), and N -> M re-slicing.

The data are a fixed *global* batch per micro-step split evenly over the ranks, so a run at any
world size computes the same averaged gradients and training continues identically after a
checkpoint is loaded at another world size.
"""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsplug
from dsplug.checkpoint import CheckpointError, MODEL_FILE, optim_file
from dsplug.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    merge_partitions,
)

from tests.dist_harness import run_distributed
from tests.engine_common import IN, OUT, loss_fn, make_model

GLOBAL_BATCH, FIRST, SECOND = 8, 3, 3
COMBOS = {
    # name: config extras (train_batch_size fixed: the micro batch follows the world size)
    "s1-bf16": {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "gradient_accumulation_steps": 2},
    "s2-fp32-clip": {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 200},
                     "gradient_accumulation_steps": 2, "gradient_clipping": 0.5},
}
TOL = {"s1-bf16": dict(rtol=2e-2, atol=2e-2), "s2-fp32-clip": dict(rtol=1e-5, atol=1e-6)}


def _engine(name, seed=0):
    extra = COMBOS[name]
    config = {"train_batch_size": GLOBAL_BATCH * extra["gradient_accumulation_steps"], "steps_per_print": 1000,
              **extra}
    return dsplug.initialize(
        model=make_model(seed), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.7), config=config)[0]


def _train(engine, steps):
    """Losses (global mean) of ``steps`` optimizer steps on this rank's share of the global batches."""
    from dsplug import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    share = GLOBAL_BATCH // world
    losses = []
    for _ in range(steps):
        step, total = engine.global_steps, 0.0
        for m in range(engine.gradient_accumulation_steps()):
            g = torch.Generator().manual_seed(7919 * step + m)
            x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            loss = loss_fn(engine(x.to(engine.precision.model_dtype)), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        t = torch.tensor([total / engine.gradient_accumulation_steps()])
        if world > 1:
            comm.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def _snapshot(engine, losses):
    return {"losses": losses, "params": [p.detach().float().clone() for p in engine.module.parameters()],
            "steps": engine.global_steps, "lr": engine.get_lr()}


def _master(engine):
    """This rank's fp32 partition (what the checkpoint must reproduce exactly)."""
    return engine.stage.opt_params[0].detach().float().clone()


def _save_and_continue(root):
    """At N ranks: train, save, keep training (the uninterrupted run); then resume a fresh engine
    from the N-rank and from the 1-rank checkpoint and continue."""
    out = {}
    for name in COMBOS:
        engine = _engine(name)
        _train(engine, FIRST)
        engine.save_checkpoint(os.path.join(root, f"{name}-n2"))
        out[(name, "master")] = _master(engine)
        out[(name, "saved_params")] = [p.detach().float().clone() for p in engine.module.parameters()]
        out[(name, "uninterrupted")] = _snapshot(engine, _train(engine, SECOND))
        for source in ("n2", "n1"):
            resumed = _engine(name, seed=1)  # other initial weights: everything must come from the checkpoint
            resumed.load_checkpoint(os.path.join(root, f"{name}-{source}"))
            out[(name, f"from-{source}")] = _snapshot(resumed, _train(resumed, SECOND))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Single-process checkpoints (made here), then the 2-process run."""
    root = str(tmp_path_factory.mktemp("zero_ckpt"))
    single = {}
    for name in COMBOS:
        engine = _engine(name)
        _train(engine, FIRST)
        engine.save_checkpoint(os.path.join(root, f"{name}-n1"))
        single[name] = _snapshot(engine, _train(engine, SECOND))
    ranks = run_distributed(_save_and_continue, 2, root)
    return {"root": root, "single": single, "ranks": ranks}


def _assert_same_run(got, want, tol):
    import numpy as np

    np.testing.assert_allclose(got["losses"], want["losses"], **tol)
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(a, b, **tol)
    assert got["steps"] == want["steps"]
    assert got["lr"] == pytest.approx(want["lr"])


# ------------------------------------------------------------------------------ resharding
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(COMBOS))
def test_resume_at_the_same_world_size_is_exact(saved, name):
    for rank_out in saved["ranks"]:
        got, want = rank_out[(name, "from-n2")], rank_out[(name, "uninterrupted")]
        assert got["losses"] == want["losses"]
        for a, b in zip(got["params"], want["params"]):
            assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(COMBOS))
def test_two_rank_checkpoint_continues_at_one_rank(saved, name):
    engine = _engine(name, seed=1)
    engine.load_checkpoint(os.path.join(saved["root"], f"{name}-n2"))
    got = _snapshot(engine, _train(engine, SECOND))
    _assert_same_run(got, saved["ranks"][0][(name, "uninterrupted")], TOL[name])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(COMBOS))
def test_one_rank_checkpoint_continues_at_two_ranks(saved, name):
    for rank_out in saved["ranks"]:
        _assert_same_run(rank_out[(name, "from-n1")], saved["single"][name], TOL[name])


# ------------------------------------------------------------------------------ zero-to-fp32
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(COMBOS))
def test_zero_to_fp32_equals_the_gathered_fp32_weights(saved, name, tmp_path):
    ckpt = os.path.join(saved["root"], f"{name}-n2")
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    names = [n for n, _ in make_model().named_parameters()]
    assert list(state) == names and all(t.dtype == torch.float32 for t in state.values())
    # exactly the two ranks' fp32 partitions, laid end to end (padding dropped)
    flat = torch.cat([saved["ranks"][r][(name, "master")] for r in range(2)])
    numel = sum(t.numel() for t in state.values())
    assert flat.numel() - numel < 2
    assert torch.equal(torch.cat([t.reshape(-1) for t in state.values()]), flat[:numel])
    for got, module_param in zip(state.values(), saved["ranks"][0][(name, "saved_params")]):
        torch.testing.assert_close(got, module_param, **TOL[name])  # the module holds them in its dtype
    # the same through the DeepSpeed import path, the loader and the command line
    from dsplug.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as deepspeed_path

    assert all(torch.equal(a, b) for a, b in zip(deepspeed_path(ckpt, tag="global_step3").values(), state.values()))
    model = load_state_dict_from_zero_checkpoint(make_model(seed=5), ckpt)
    assert all(torch.equal(p.detach(), state[n]) for n, p in model.named_parameters())
    from dsplug.cli import main

    out = tmp_path / "consolidated.bin"
    assert main(["zero-to-fp32", ckpt, str(out), "--tag", "global_step3"]) == 0
    written = torch.load(out, weights_only=True)
    assert list(written) == names and all(torch.equal(written[n], state[n]) for n in names)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_missing_rank_file_and_bad_tags_are_named(saved, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(saved["root"], "s2-fp32-clip-n2"), broken)
    os.remove(broken / "global_step3" / optim_file(1))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is missing: the checkpoint "
                                              r"was saved by 2 ranks"):
        get_fp32_state_dict_from_zero_checkpoint(broken)
    with pytest.raises(CheckpointError, match=r"tag directory .*global_step9 does not exist \(tags in .*: global_step3\)"):
        get_fp32_state_dict_from_zero_checkpoint(broken, tag="global_step9")
    os.remove(broken / "latest")
    with pytest.raises(CheckpointError, match="has no 'latest' file and no tag was given"):
        get_fp32_state_dict_from_zero_checkpoint(broken)
    from dsplug.cli import main

    assert main(["zero-to-fp32", str(broken), str(tmp_path / "x.bin")]) == 1
    assert "no 'latest' file" in capsys.readouterr().err


def test_stage0_checkpoint_is_explained(tmp_path):
    engine = dsplug.initialize(model=make_model(), optimizer=lambda g: torch.optim.SGD(g, lr=0.1),
                               config={"train_batch_size": 4})[0]
    engine.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"not saved by a partitioned ZeRO stage .*full module weights"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    stage1 = dsplug.initialize(model=make_model(), optimizer=lambda g: torch.optim.SGD(g, lr=0.1),
                               config={"train_batch_size": 4, "zero_optimization": {"stage": 1}})[0]
    with pytest.raises(CheckpointError, match=r"saved without partitions \(ZeRO stage 0\).*load_module_only=True"):
        stage1.load_checkpoint(tmp_path)
    stage1.load_checkpoint(tmp_path, load_module_only=True)
    assert all(torch.equal(a, b) for a, b in zip(stage1.module.parameters(), engine.module.parameters()))


def test_load_from_fp32_weights_false_takes_the_16bit_module_weights(tmp_path):
    def engine(flag):
        return dsplug.initialize(model=make_model(), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2), config={
            "train_batch_size": 4, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "load_from_fp32_weights": flag}})[0]

    source = engine(True)
    for _ in range(2):
        source.backward(source(torch.randn(4, IN).bfloat16()).float().pow(2).mean())
        source.step()
    source.save_checkpoint(tmp_path)
    exact, rounded = engine(True), engine(False)
    exact.load_checkpoint(tmp_path)
    rounded.load_checkpoint(tmp_path)
    master = source.stage.opt_params[0]
    assert torch.equal(exact.stage.opt_params[0], master)
    assert torch.equal(rounded.stage.opt_params[0], master.bfloat16().float())
    assert not torch.equal(master.bfloat16().float(), master)


# ------------------------------------------------------------------------------ per_param (stage 3) layout
def _per_param_checkpoint(directory, world=3, buffer=True):
    """A stage-3-style checkpoint written by hand: every parameter split on its own."""
    model = make_model(seed=4)
    named = list(model.named_parameters())
    fp32 = {n: p.detach().float() for n, p in named}
    exp_avg = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in enumerate(named)}
    pieces = {r: ([], []) for r in range(world)}
    for n, _ in named:
        chunk = math.ceil(fp32[n].numel() / world)
        for values, index in ((fp32[n], 0), (exp_avg[n], 1)):
            padded = torch.zeros(chunk * world)
            padded[:values.numel()] = values.reshape(-1)
            for r in range(world):
                pieces[r][index].append(padded[r * chunk:(r + 1) * chunk])
    partition = sum(math.ceil(p.numel() / world) for _, p in named)
    tag = directory / "global_step5"
    tag.mkdir(parents=True)
    for r in range(world):
        group = {"names": [n for n, _ in named], "shapes": [p.shape for _, p in named],
                 "numel": sum(p.numel() for _, p in named), "partition_numel": partition,
                 "fp32": torch.cat(pieces[r][0]),
                 "state": {"exp_avg": torch.cat(pieces[r][1]), "exp_avg_sq": torch.cat(pieces[r][1]).abs(),
                           "step": torch.tensor(5.0)},
                 "hyper": {"lr": 0.003, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}}
        stage = {"zero_stage": 3, "layout": "per_param", "world_size": world, "rank": r, "groups": [group]}
        torch.save({"stage": stage, "precision": {"loss_scaler": None}, "rank": r, "world_size": world},
                   tag / optim_file(r))
    module = {n: p.detach().bfloat16() for n, p in named}
    if buffer:
        module["running_stat"] = torch.arange(3.0)  # a buffer: passed through as saved
    torch.save({"module": module, "global_steps": 5, "global_samples": 20, "micro_steps": 5, "skipped_steps": 0,
                "lr_scheduler": None, "client_state": {}, "observers": [], "world_size": world, "zero_stage": 3},
               tag / MODEL_FILE)
    (directory / "latest").write_text("global_step5")
    return fp32, exp_avg


def test_per_param_layout_consolidates(tmp_path):
    fp32, exp_avg = _per_param_checkpoint(tmp_path)
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert list(state) == list(fp32) + ["running_stat"]
    assert all(torch.equal(state[n], fp32[n]) for n in fp32)
    assert torch.equal(state["running_stat"], torch.arange(3.0))
    from dsplug.zero_to_fp32 import read_rank_states

    merged = merge_partitions(read_rank_states(str(tmp_path / "global_step5")))
    assert all(torch.equal(merged[0].state["exp_avg"][n], exp_avg[n]) for n in fp32)
    assert float(merged[0].scalars["step"]) == 5.0 and merged[0].hyper["lr"] == 0.003
    out = convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path)  # a directory: pytorch_model.bin in it
    assert os.path.isfile(tmp_path / "pytorch_model.bin") and list(out) == list(state)


@pytest.mark.parametrize("stage", [1, 2])
def test_per_param_checkpoint_from_three_ranks_loads_into_stage12_at_one_rank(tmp_path, stage):
    fp32, exp_avg = _per_param_checkpoint(tmp_path, buffer=False)
    engine = dsplug.initialize(model=make_model(), optimizer=lambda g: torch.optim.Adam(g, lr=1e-2), config={
        "train_batch_size": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}})[0]
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 5
    numel = sum(t.numel() for t in fp32.values())  # the partition is padded to a multiple of 2 x world size
    assert torch.equal(engine.stage.opt_params[0][:numel], torch.cat([fp32[n].reshape(-1) for n in fp32]))
    state = engine.optimizer.state[engine.optimizer.param_groups[0]["params"][0]]
    assert torch.equal(state["exp_avg"][:numel], torch.cat([exp_avg[n].reshape(-1) for n in fp32]))
    assert float(state["step"]) == 5.0 and engine.get_lr() == [0.003]


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=6),
       world=st.integers(1, 5), layout=st.sampled_from(["contiguous", "per_param"]))
def test_merge_rebuilds_any_layout(shapes, world, layout):
    """Rank partitions built independently (torch.cat / pad / chunk) merge back into the tensors."""
    tensors = {f"p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    states = [{"fp32": [], "m": []} for _ in range(world)]
    if layout == "contiguous":
        flat = torch.cat([t.reshape(-1) for t in tensors.values()])
        padded = torch.cat([flat, torch.zeros(-flat.numel() % world)])
        for r, piece in enumerate(padded.chunk(world)):
            states[r]["fp32"], states[r]["m"] = [piece], [piece * 3]
    else:
        for t in tensors.values():
            flat = t.reshape(-1)
            padded = torch.cat([flat, torch.zeros(-flat.numel() % world)])
            for r, piece in enumerate(padded.chunk(world)):
                states[r]["fp32"].append(piece)
                states[r]["m"].append(piece * 3)
    rank_states = []
    for r in range(world):
        fp32 = torch.cat(states[r]["fp32"])
        group = {"names": list(tensors), "shapes": [t.shape for t in tensors.values()],
                 "numel": sum(t.numel() for t in tensors.values()), "partition_numel": fp32.numel(), "fp32": fp32,
                 "state": {"m": torch.cat(states[r]["m"]), "step": 2}, "hyper": {}}
        rank_states.append({"zero_stage": 2, "layout": layout, "world_size": world, "rank": r, "groups": [group]})
    (merged,) = merge_partitions(rank_states)
    for name, t in tensors.items():
        assert torch.equal(merged.fp32[name], t)
        assert torch.equal(merged.state["m"][name], t * 3)
    assert merged.scalars == {"step": 2}


class _CounterStateSGD(torch.optim.Optimizer):
    """SGD whose state holds a Python int and a one-element tensor counter (not element-wise),
    as DeepSpeed's HybridStateOptimizer test optimizer does."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["integer_step"], state["tensor_step"] = 0, torch.zeros(1)
                p.add_(p.grad, alpha=-group["lr"])
                state["integer_step"] += 1
                state["tensor_step"] += 1


@pytest.mark.parametrize("stage", [1, 2])
def test_one_element_state_tensors_are_saved_per_group_and_resume_exactly(tmp_path, stage):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}

    def build():
        torch.manual_seed(0)
        model = make_model()
        return dsplug.initialize(model=model, optimizer=_CounterStateSGD(model.parameters()), config=config)[0]

    def train(engine, steps, start):
        for i in range(start, start + steps):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(2, IN, generator=gen), torch.randn(2, OUT, generator=gen)
            engine.backward(loss_fn(engine(x), y))
            engine.step()

    first = build()
    train(first, 3, 0)
    first.save_checkpoint(str(tmp_path), tag="t")
    train(first, 2, 3)
    resumed = build()
    resumed.load_checkpoint(str(tmp_path), tag="t")
    states = list(resumed.optimizer.state.values())
    assert states and all(s["integer_step"] == 3 and torch.equal(s["tensor_step"], torch.tensor([3.0]))
                          for s in states)
    train(resumed, 2, 3)
    for got, want in zip(resumed.module.parameters(), first.module.parameters()):
        assert torch.equal(got, want)


def _log_calls(monkeypatch, level):
    from dsplug.utils import logger

    calls = []
    monkeypatch.setattr(logger, level, lambda message, *args, **kwargs: calls.append(message % args))
    return calls


def test_recovery_script_is_executable_and_a_refused_chmod_only_logs(tmp_path, monkeypatch):
    """``zero_to_fp32.py`` beside the checkpoints is executable, as DeepSpeed's; a file system that
    refuses chmod (a cloud file share) logs at info level and the save still lands (DeepSpeed's
    test_chmod_exception_handling calls the engine's private ``_change_recovery_script_permissions``)."""
    import stat

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    engine = dsplug.initialize(model=make_model(), optimizer=lambda g: torch.optim.SGD(g, lr=0.1),
                               config=config)[0]
    engine.save_checkpoint(str(tmp_path / "ok"), tag="t")
    script = tmp_path / "ok" / "zero_to_fp32.py"
    assert os.stat(script).st_mode & stat.S_IXUSR

    infos = _log_calls(monkeypatch, "info")
    engine._change_recovery_script_permissions(str(tmp_path / "missing" / "zero_to_fp32.py"))
    assert len(infos) == 1 and "could not make" in infos[0] and "python zero_to_fp32.py" in infos[0]

    def refuse(path, mode):
        raise PermissionError(1, "Operation not permitted", path)

    infos.clear()
    monkeypatch.setattr(os, "chmod", refuse)
    engine.save_checkpoint(str(tmp_path / "share"), tag="t")
    assert (tmp_path / "share" / "t" / MODEL_FILE).is_file() and (tmp_path / "share" / "zero_to_fp32.py").is_file()
    assert any("Operation not permitted" in m for m in infos), infos
