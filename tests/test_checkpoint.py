"""Checkpoints: exact resume in a fresh process, crash safety, clear errors."""
from __future__ import annotations

import os
import signal

import pytest
import torch

import dsplug
from dsplug.checkpoint import CheckpointError

from .dist_harness import run_distributed
from .engine_common import IN, OUT, batch, loss_fn

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
          "gradient_clipping": 1.0, "fp16": {"enabled": True, "initial_scale_power": 5, "loss_scale_window": 3}}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, OUT))


def _engine(config=CONFIG):
    return dsplug.initialize(
        model=_model(), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.7), config=config)[0]


def _train(engine, steps):
    from dsplug import comm

    for _ in range(steps):
        step = engine.global_steps
        for m in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, m, comm.get_rank(), engine.train_micro_batch_size_per_gpu())
            engine.backward(loss_fn(engine(x.half()), y))
            engine.step()


def _state(engine):
    return {"params": [p.detach().clone() for p in engine.module.parameters()],
            "steps": engine.global_steps, "samples": engine.global_samples, "scale": engine.get_loss_scale(),
            "lr": engine.get_lr(), "rng": torch.rand(3)}


def _uninterrupted(steps):
    engine = _engine()
    _train(engine, steps)
    return _state(engine)


def _first_half(save_dir, steps):
    engine = _engine()
    _train(engine, steps)
    engine.save_checkpoint(save_dir, client_state={"epoch": 7, "note": "half"})
    return engine.global_steps


def _second_half(save_dir, steps):
    engine = _engine()
    path, client = engine.load_checkpoint(save_dir)
    assert client == {"epoch": 7, "note": "half"}
    _train(engine, steps)
    return _state(engine)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_resume_in_fresh_processes_is_bit_exact(tmp_path, world):
    k = 3
    want = run_distributed(_uninterrupted, world, 2 * k)
    assert run_distributed(_first_half, world, str(tmp_path), k) == [k] * world
    got = run_distributed(_second_half, world, str(tmp_path), k)
    for g, w in zip(got, want):
        assert g["steps"] == w["steps"] == 2 * k and g["samples"] == w["samples"]
        assert g["scale"] == w["scale"] and g["lr"] == w["lr"]
        for a, b in zip(g["params"], w["params"]):
            assert torch.equal(a, b)
        assert torch.equal(g["rng"], w["rng"])  # RNG streams continue exactly


def test_layout_and_latest(tmp_path):
    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step2"
    files = sorted(os.listdir(tmp_path / "global_step2"))
    assert files == ["mp_rank_00_model_states.pt", "rng_state_rank_0.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    engine.save_checkpoint(tmp_path, tag="manual", save_latest=False)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not any(name.endswith(".partial") for name in os.listdir(tmp_path))


def _crash_during_save(save_dir, same_tag):
    """Save once, train on, then die (SIGKILL) after the second save has written its first file."""
    from dsplug import checkpoint as ckpt

    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(save_dir, tag="stable")
    before = [p.detach().clone() for p in engine.module.parameters()]
    torch.save(before, os.path.join(save_dir, "expected.pt"))
    _train(engine, 2)
    real = ckpt.atomic_save

    def dying_save(obj, path):
        real(obj, path)
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt.atomic_save = dying_save
    engine.save_checkpoint(save_dir, tag="stable" if same_tag else "next")


@pytest.mark.parametrize("same_tag", [False, True])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, same_tag):
    with pytest.raises(RuntimeError, match="died without a result"):
        run_distributed(_crash_during_save, 1, str(tmp_path), same_tag)
    assert (tmp_path / "latest").read_text() == "stable"
    engine = _engine()
    path, _ = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "stable")
    expected = torch.load(tmp_path / "expected.pt")
    for a, b in zip(engine.module.parameters(), expected):
        assert torch.equal(a.detach(), b)
    assert engine.global_steps == 2


def test_missing_and_corrupt_files_are_named(tmp_path):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    optim = tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint file {optim} is missing"):
        _engine().load_checkpoint(tmp_path)
    model_file = tmp_path / "t" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=f"checkpoint file {model_file} is corrupt or unreadable"):
        _engine().load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint .*nope does not exist; tags in .*: t"):
        _engine().load_checkpoint(tmp_path, tag="nope")


def test_missing_latest_loads_nothing_like_deepspeed(tmp_path, capsys):
    assert _engine().load_checkpoint(tmp_path) == (None, None)
    assert "no 'latest' file" in capsys.readouterr().out


class Opaque:
    def __init__(self, value):
        self.value = value


def test_weights_only_refuses_arbitrary_objects_unless_opted_out(tmp_path):
    engine = _engine()
    engine.save_checkpoint(tmp_path, client_state={"obj": Opaque(3)})
    with pytest.raises(CheckpointError, match=r'"checkpoint": \{"weights_only": false\}'):
        _engine().load_checkpoint(tmp_path)
    trusting = _engine({**CONFIG, "checkpoint": {"weights_only": False}})
    _, client = trusting.load_checkpoint(tmp_path)
    assert client["obj"].value == 3


def test_load_module_only_keeps_fresh_optimizer(tmp_path):
    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(tmp_path)
    fresh = _engine()
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert fresh.global_steps == 0
    for a, b in zip(fresh.module.parameters(), engine.module.parameters()):
        assert torch.equal(a, b)
    assert not fresh.optimizer.state  # optimizer state was not loaded
