"""Checkpoints: exact resume in a fresh process, crash safety, clear errors."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import dsplug
from dsplug.checkpoint import CheckpointError

from tests.dist_harness import run_distributed
from tests.engine_common import IN, OUT, batch, loss_fn

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
    assert files == ["manifest.json", "mp_rank_00_model_states.pt", "rng_state_rank_0.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    manifest = json.loads((tmp_path / "global_step2" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == files[1:] and manifest["global_steps"] == 2
    for name, entry in manifest["files"].items():  # the manifest is an independent sha256 of each file
        data = (tmp_path / "global_step2" / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
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
    with pytest.raises(CheckpointError, match=f"checkpoint file {model_file} has 16 bytes but its manifest says"):
        _engine().load_checkpoint(tmp_path)
    (tmp_path / "t" / "manifest.json").unlink()  # dsplug's files without the manifest: refused, naming it
    with pytest.raises(CheckpointError, match=f"{tmp_path / 't' / 'manifest.json'} is missing"):
        _engine().load_checkpoint(tmp_path)
    unverified = _engine({**CONFIG, "checkpoint": {"require_manifest": False}})  # the opt-out: torch.load says it
    with pytest.raises(CheckpointError, match=f"checkpoint file {model_file} is corrupt or unreadable"):
        unverified.load_checkpoint(tmp_path)
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


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                  "rng_state_rank_0.pt"])
def test_a_flipped_byte_in_any_file_is_detected_naming_it(tmp_path, name):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    path = tmp_path / "t" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{name} does not match its manifest"):
        _engine().load_checkpoint(tmp_path)
    verify = subprocess.run([sys.executable, "-m", "dsplug.cli", "checkpoint", "verify", str(tmp_path)],
                            capture_output=True, text=True)
    assert verify.returncode == 1 and f"{name} does not match its manifest" in verify.stdout


def test_checkpoint_verify_passes_a_good_checkpoint(tmp_path):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="a")
    engine.save_checkpoint(tmp_path, tag="b")
    out = subprocess.run([sys.executable, "-m", "dsplug.cli", "checkpoint", "verify", str(tmp_path), "--all"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.count("OK ") == 2, out.stdout + out.stderr


def test_resume_follows_latest_else_the_most_recently_saved_verified_tag(tmp_path, capsys):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path)
    _train(engine, 1)
    engine.save_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("global_step1")  # as if the save died before moving 'latest'
    engine.save_checkpoint(tmp_path, tag="scratch", save_latest=False)  # not a resume candidate
    fresh = _engine()
    path, _ = fresh.load_checkpoint(tmp_path)  # 'latest' names a complete, verified tag: followed
    assert path == str(tmp_path / "global_step1") and fresh.global_steps == 1
    assert "'global_step2' was saved after it but 'latest' never moved to it" in capsys.readouterr().out
    (tmp_path / "latest").unlink()
    path, _ = _engine().load_checkpoint(tmp_path)  # no 'latest': the most recently saved
    assert path == str(tmp_path / "global_step2")
    assert "no 'latest' file" in capsys.readouterr().out
    (tmp_path / "latest").write_text("global_step2")
    shard = tmp_path / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    path, _ = _engine().load_checkpoint(tmp_path)  # 'latest' fails verification: the one saved before it
    assert path == str(tmp_path / "global_step1")
    out = capsys.readouterr().out
    assert "names 'global_step2', but it fails verification" in out and "loading 'global_step1'" in out


def test_latest_must_name_a_tag_inside_the_directory(tmp_path):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path)
    for bad in ("/etc", "../elsewhere", ".."):
        (tmp_path / "latest").write_text(bad)
        with pytest.raises(CheckpointError, match="which is not a tag directory inside"):
            _engine().load_checkpoint(tmp_path)


def test_keep_last_deletes_old_tags_only_after_the_new_one_is_complete(tmp_path):
    engine = _engine({**CONFIG, "checkpoint": {"keep_last": 2}})
    real = ckpt_module().commit
    seen = []

    def commit(save_dir, tag, save_latest):  # what is on disk while a save commits
        seen.append(sorted(n for n in os.listdir(save_dir) if n.startswith("global_step")))
        return real(save_dir, tag, save_latest)

    ckpt_module().commit = commit
    try:
        for _ in range(4):
            _train(engine, 1)
            engine.save_checkpoint(tmp_path)
    finally:
        ckpt_module().commit = real
    assert seen[-1] == ["global_step2", "global_step3", "global_step4.partial"]  # old ones kept until then
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("global")) == ["global_step3", "global_step4"]
    assert (tmp_path / "latest").read_text() == "global_step4"


def ckpt_module():
    from dsplug import checkpoint

    return checkpoint


def test_leftovers_of_dead_savers_are_reclaimed_and_live_ones_kept(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = __import__("socket").gethostname()
    for name, pid in (("x.partial", dead.pid), ("y.partial", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner.json").write_text(json.dumps({"pid": pid, "host": host}))
    (tmp_path / f"latest.tmp-{dead.pid}").write_text("junk")
    (tmp_path / "z.partial").mkdir()  # no owner record: not ours to judge
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path)
    left = sorted(os.listdir(tmp_path))
    assert "x.partial" not in left and f"latest.tmp-{dead.pid}" not in left
    assert "y.partial" in left and "z.partial" in left
    assert f"removed leftovers of crashed saves in {tmp_path}: latest.tmp-{dead.pid}, x.partial" in capsys.readouterr().out


def _load_with_bad_shard_on_rank_one(save_dir):
    from dsplug import comm

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(save_dir, tag="t")
    comm.barrier()
    if comm.get_rank() == 0:
        path = os.path.join(save_dir, "t", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        with open(path, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    comm.barrier()
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_a_bad_shard_on_one_rank_fails_every_rank_with_the_same_error(tmp_path):
    messages = run_distributed(_load_with_bad_shard_on_rank_one, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert "reading failed on rank 1" in messages[0] and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in messages[0]
