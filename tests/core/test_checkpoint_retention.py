"""keep_last by lineage, and which tag an automatic resume loads (core/checkpoint/retention.py)."""
from __future__ import annotations

import json
import os

import torch

import dsplug
from tests.engine_common import batch, loss_fn, make_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


def _engine(keep_last=None):
    config = dict(CONFIG, checkpoint={"keep_last": keep_last}) if keep_last else CONFIG
    return dsplug.initialize(model=make_model(), config=config)[0]


def _train(engine, steps=1):
    for _ in range(steps):
        x, y = batch(engine.global_steps, 0, 0, 2)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def _params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def _tags(save_dir):
    return sorted(n for n in os.listdir(save_dir) if n.startswith("s") and os.path.isdir(os.path.join(save_dir, n)))


def _manifest(save_dir, tag):
    return json.loads((save_dir / tag / "manifest.json").read_text())


def test_a_rollback_keeps_the_loaded_tag_and_drops_the_abandoned_branch_first(tmp_path, capsys):
    """The issue's case: keep_last=3, saves 10, 20, 30; load 10, train on, save 15."""
    first = _engine(keep_last=3)
    for tag in ("s10", "s20", "s30"):
        _train(first)
        first.save_checkpoint(tmp_path, tag=tag)
    assert [_manifest(tmp_path, t)["parent"] for t in ("s10", "s20", "s30")] == [None, "s10", "s20"]

    rolled = _engine(keep_last=3)
    rolled.load_checkpoint(tmp_path, tag="s10")
    _train(rolled)
    rolled.save_checkpoint(tmp_path, tag="s15")
    assert _tags(tmp_path) == ["s10", "s15", "s30"]  # the abandoned s20 went, not the loaded s10
    assert _manifest(tmp_path, "s15")["parent"] == "s10"
    assert _manifest(tmp_path, "s15")["save_seq"] > _manifest(tmp_path, "s30")["save_seq"]
    assert (tmp_path / "latest").read_text() == "s15"
    after_15 = _params(rolled)

    # automatic resume follows 'latest' (s15), not the highest step (s30), and says nothing odd
    capsys.readouterr()
    fresh = _engine()
    path, _ = fresh.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "s15")
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), after_15))
    assert "warning" not in capsys.readouterr().out

    _train(rolled)
    rolled.save_checkpoint(tmp_path, tag="s25")
    assert _tags(tmp_path) == ["s10", "s15", "s25"]  # the rest of the abandoned branch
    _train(rolled)
    rolled.save_checkpoint(tmp_path, tag="s35")
    assert _tags(tmp_path) == ["s10", "s25", "s35"]  # s10 stays: this run loaded it

    # without 'latest', resume takes the most recently saved complete tag and says so
    (tmp_path / "latest").unlink()
    capsys.readouterr()
    path, _ = _engine().load_checkpoint(tmp_path)
    assert path == str(tmp_path / "s35")
    assert "loading 's35'" in capsys.readouterr().out


def test_the_tag_latest_names_is_never_pruned(tmp_path):
    engine = _engine(keep_last=1)
    _train(engine)
    engine.save_checkpoint(tmp_path, tag="s1")
    _train(engine)
    engine.save_checkpoint(tmp_path, tag="s2", save_latest=False)  # 'latest' still names s1
    assert _tags(tmp_path) == ["s1", "s2"]
    _train(engine)
    engine.save_checkpoint(tmp_path, tag="s3")
    assert _tags(tmp_path) == ["s3"]


def test_resume_prefers_the_most_recently_saved_over_the_highest_step(tmp_path, capsys):
    engine = _engine()
    _train(engine, 3)
    engine.save_checkpoint(tmp_path, tag="s_high")  # step 3
    back = _engine()
    _train(back, 1)
    back.save_checkpoint(tmp_path, tag="s_low")  # step 1, saved later
    os.unlink(tmp_path / "latest")
    path, _ = _engine().load_checkpoint(tmp_path)
    assert path == str(tmp_path / "s_low")
