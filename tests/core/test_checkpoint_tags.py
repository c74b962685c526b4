"""Checkpoint tags: one rule set for save and load tags (and the tag ``latest`` names); whatever a
load reads resolves inside the checkpoint directory."""
from __future__ import annotations

import os

import pytest
import torch

import dsplug
from dsplug import checkpoint as ckpt
from dsplug.checkpoint import CheckpointError
from tests.engine_common import batch, loss_fn, make_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


def _engine():
    return dsplug.initialize(model=make_model(), config=CONFIG)[0]


def _step(engine, step=0):
    x, y = batch(step, 0, 0, 2)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def _params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


#: (bad tag, words of the rule the error names)
BAD_TAGS = [
    ("latest", "a name dsplug writes"), ("LATEST", "a name dsplug writes"),
    ("manifest.json", "a name dsplug writes"), ("zero_to_fp32.py", "a name dsplug writes"),
    ("owner.json", "a name dsplug writes"),
    ("a/b", "path separator"), ("a\\b", "path separator"), ("../other/global_step1", "'..'"), ("..", "'..'"),
    (".", "'..'"), ("/etc", "absolute path"), ("a\x00b", "control character"), ("foo\nbar", "control character"),
    ("tab\there", "control character"), ("-rf", "starts with '-'"), (" ", "only whitespace"),
    ("\t \n", "only whitespace"), (" lead", "starts or ends with whitespace"), ("", "empty"),
    ("x" * 300, "300 bytes"), ("é" * 124, "248 bytes"), ("t.partial", ".partial"), ("t.old", ".partial or .old"),
    ("latest.tmp-12", ".tmp-"),
]


@pytest.mark.parametrize("tag,rule", BAD_TAGS, ids=[repr(t)[:20] for t, _ in BAD_TAGS])
def test_check_tag_names_the_rule_in_one_line(tag, rule):
    with pytest.raises(CheckpointError) as info:
        ckpt.check_tag(tag)
    message = str(info.value)
    assert rule in message and "\n" not in message and "\x00" not in message and len(message) < 400, message


@pytest.mark.parametrize("tag", ["global_step10", "best", "epoch-3.step_7", "x" * 247, "é" * 123, "a b", "ünï",
                                 "latest2", "my.old.run"])
def test_plain_names_are_valid_tags(tag):
    assert ckpt.check_tag(tag) == tag


def test_bad_save_tags_are_refused_and_leave_the_directory_working(tmp_path):
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(tmp_path, tag="good")
    before = sorted(os.listdir(tmp_path))
    for tag, rule in BAD_TAGS:
        with pytest.raises(CheckpointError, match=rule.replace(".", r"\.").replace("(", r"\(")):
            engine.save_checkpoint(tmp_path, tag=tag)
        assert sorted(os.listdir(tmp_path)) == before, tag
    assert (tmp_path / "latest").is_file() and (tmp_path / "latest").read_text() == "good"
    _step(engine, 1)
    engine.save_checkpoint(tmp_path)  # later saves still work
    assert (tmp_path / "latest").read_text() == "global_step2"


def test_load_tags_are_checked_like_save_tags(tmp_path):
    other = tmp_path / "other"
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(other, tag="global_step1")
    mine = tmp_path / "mine"
    engine.save_checkpoint(mine, tag="t")
    for tag in ("../other/global_step1", str(other / "global_step1"), "latest", "t\n", "-t"):
        with pytest.raises(CheckpointError, match="is not valid"):
            _engine().load_checkpoint(mine, tag=tag)


def test_a_tag_directory_linking_outside_is_not_loaded(tmp_path):
    elsewhere, mine = tmp_path / "elsewhere", tmp_path / "mine"
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(elsewhere, tag="foreign")
    engine.save_checkpoint(mine, tag="own")
    os.symlink(elsewhere / "foreign", mine / "linked")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        _engine().load_checkpoint(mine, tag="linked")
    (mine / "latest").write_text("linked")  # nor when 'latest' names it
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        _engine().load_checkpoint(mine)
    os.symlink(mine / "own", mine / "best")  # a link to a tag inside is fine
    fresh = _engine()
    path, _ = fresh.load_checkpoint(mine, tag="best")
    assert path == str(mine / "best")
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh), _params(engine)))


def test_a_file_linking_outside_the_checkpoint_is_not_loaded(tmp_path):
    elsewhere, mine = tmp_path / "elsewhere", tmp_path / "mine"
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(elsewhere, tag="t")
    engine.save_checkpoint(mine, tag="t")
    target = mine / "t" / "mp_rank_00_model_states.pt"
    target.unlink()
    os.symlink(elsewhere / "t" / "mp_rank_00_model_states.pt", target)  # same bytes: the manifest would pass
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        _engine().load_checkpoint(mine, tag="t")


@pytest.mark.parametrize("save_dir", [None, ""])
def test_a_save_without_a_directory_is_a_value_error_naming_it(save_dir):
    engine = _engine()
    with pytest.raises(ValueError, match=f"save_dir is {save_dir!r}; give the directory"):
        engine.save_checkpoint(save_dir)


def _save_with_each_ranks_own_tag(folder, mode):
    import torch.distributed as dist

    engine = dsplug.initialize(model=make_model(), config={**CONFIG, "checkpoint": {"tag_validation": mode}})[0]
    x, y = batch(0, 0, dist.get_rank(), 2)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    try:
        engine.save_checkpoint(folder, tag=f"tag-{dist.get_rank()}")
    except ckpt.TagMismatchError as e:
        return {"refused": str(e), "listing": sorted(os.listdir(folder)) if os.path.isdir(folder) else []}
    fresh = dsplug.initialize(model=make_model(seed=1), config=CONFIG)[0]
    path, _ = fresh.load_checkpoint(folder)
    return {"listing": sorted(os.listdir(folder)), "loaded": path,
            "equal": all(torch.equal(a, b) for a, b in zip(_params(fresh), _params(engine)))}


@pytest.mark.parametrize("mode", ["Warn", "Ignore", "Fail"])
def test_ranks_passing_different_tags_save_under_rank_0s_unless_validation_fails(tmp_path, mode):
    """DeepSpeed's tag_validation: Fail refuses (an AssertionError, as its tests expect) and writes
    nothing; Warn and Ignore save, and dsplug keeps the checkpoint whole under rank 0's tag."""
    from tests.dist_harness import run_distributed

    results = run_distributed(_save_with_each_ranks_own_tag, 2, str(tmp_path / "ck"), mode)
    if mode == "Fail":
        for r in results:
            assert "checkpoint tags differ across ranks: ['tag-0', 'tag-1']" in r["refused"]
            assert r["listing"] == []
        assert issubclass(ckpt.TagMismatchError, AssertionError)
        return
    for r in results:
        assert r["listing"] == ["latest", "tag-0"] and r["loaded"].endswith("tag-0") and r["equal"]
