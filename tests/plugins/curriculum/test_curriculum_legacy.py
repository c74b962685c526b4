"""Legacy curriculum learning (the top-level ``curriculum_learning`` section): the difficulty of
each global step equals DeepSpeed's closed forms (fixed_linear, fixed_root, fixed_discrete,
rounding included), the engine passes ``curriculum_seqlen`` to every training forward (from
``global_steps + 1``), a resumed run continues the schedule exactly, the documented example
checks and trains the built-in LM through ``dsplug train --config FILE``, and bad configs name
the key."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dsplug.cli import main as cli_main
from dsplug.config import check_config
from dsplug.plugins.curriculum.scheduler import CurriculumScheduler
from dsplug.plugins.train.model import CharTransformer
from dsplug.plugins.train.options import resolve_config_option
from dsplug.testing import ObserverContract, tiny_engine, tiny_model, train_steps

#: the example of DeepSpeed's config reference ("Curriculum Learning")
DOC_EXAMPLE = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": 1024,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 40000, "difficulty_step": 8},
}
TRAIN_BASE = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.006}}}
TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--sample-chars", "0"]


def section(schedule_type, schedule_config, min_difficulty=8, max_difficulty=100):
    return {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": min_difficulty,
            "max_difficulty": max_difficulty, "schedule_type": schedule_type, "schedule_config": schedule_config}


class SeqlenModel(torch.nn.Module):
    """tiny_model whose output depends on ``curriculum_seqlen``, recording every value it gets."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_model()
        self.seen = []

    def forward(self, x, curriculum_seqlen=None):
        self.seen.append(curriculum_seqlen)
        return self.inner(x) * (1.0 + (curriculum_seqlen or 0) / 64)


def engine_with(curriculum, **config):
    model = SeqlenModel()
    return tiny_engine({"curriculum_learning": curriculum, **config}, model=model), model


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ the closed forms
def closed_root(s, lo, hi, total, step, degree):
    d = math.floor((s / total) ** (1 / degree) * (hi - lo) + lo)
    return min(d - d % step, hi)


@pytest.mark.parametrize("schedule_type,degree", [("fixed_linear", 1), ("fixed_root", 2), ("fixed_root", 3)])
def test_fixed_linear_and_root_follow_the_closed_form(schedule_type, degree):
    config = {"total_curriculum_step": 100, "difficulty_step": 8}
    if schedule_type == "fixed_root":
        config["root_degree"] = degree
    scheduler = CurriculumScheduler(section(schedule_type, config, 8, 100))
    got = [scheduler.get_difficulty(s) for s in range(0, 130)]
    assert got == [closed_root(s, 8, 100, 100, 8, degree) for s in range(0, 130)]
    assert all(d % 8 == 0 or d == 100 for d in got) and got == sorted(got)


def test_rounding_and_end_of_schedule_hand_computed():
    linear = CurriculumScheduler(DOC_EXAMPLE)
    # floor(s / 40000 * 1016 + 8), rounded down to a multiple of 8, at most 1024
    assert [linear.get_difficulty(s) for s in (0, 1, 315, 20000, 39999, 40000, 50000)] == \
        [8, 8, 16, 512, 1016, 1024, 1024]
    root = CurriculumScheduler(section("fixed_root", {"total_curriculum_step": 100, "difficulty_step": 8,
                                                      "root_degree": 2}, 8, 100))
    # sqrt(0.25) * 92 + 8 = 54 -> 48; at s = total: 100 -> 96 (max is no multiple of 8: DeepSpeed does
    # not clamp the ratio, so 100 comes once the unclamped value rounds down to 104, at s = 109)
    assert [root.get_difficulty(s) for s in (0, 25, 100, 108, 109)] == [8, 48, 96, 96, 100]


def test_fixed_discrete_levels():
    scheduler = CurriculumScheduler(section("fixed_discrete", {"difficulty": [8, 16, 32], "max_step": [5, 10]},
                                            8, 32))
    assert [scheduler.get_difficulty(s) for s in range(0, 14)] == [8] * 6 + [16] * 5 + [32] * 3


# ------------------------------------------------------------------------------ in the engine
def test_every_training_forward_gets_the_difficulty_of_global_steps_plus_one():
    curriculum = section("fixed_linear", {"total_curriculum_step": 6, "difficulty_step": 4}, 4, 28)
    engine, model = engine_with(curriculum, gradient_accumulation_steps=2, train_batch_size=4)
    train_steps(engine, 8)
    expected = [closed_root(g + 1, 4, 28, 6, 4, 1) for g in range(8)]
    assert model.seen == [d for d in expected for _ in range(2)]  # both micro-steps of step g
    assert engine.curriculum_enabled_legacy() is True
    assert engine.curriculum_params_legacy() == {k: v for k, v in curriculum.items() if k != "enabled"}
    assert engine.curriculum_scheduler_legacy.get_current_difficulty() == expected[-1] == 28

    engine.eval()  # eval forwards: nothing passed, nothing updated (DeepSpeed's engine.forward)
    engine(torch.zeros(2, 8))
    engine.train()
    engine(torch.zeros(2, 8), curriculum_seqlen=3)  # the caller's keyword wins
    assert model.seen[-2:] == [None, 3]
    engine.destroy()


def test_engine_without_the_section():
    engine, model = engine_with({"enabled": False})
    train_steps(engine, 1)
    assert model.seen == [None]
    assert engine.curriculum_enabled_legacy() is False
    assert not hasattr(engine, "curriculum_scheduler_legacy")
    engine.destroy()
    plain = tiny_engine()
    assert plain.curriculum_params_legacy() is False
    plain.destroy()


class TestCurriculumObserver(ObserverContract):
    """Discovery, config check and typo path, the bus, checkpoint round trip; the resumed run's
    losses depend on the difficulty. The schedule rises to max_difficulty at step 2 and then
    says 16: DeepSpeed's scheduler stays at the max once reached, which only the saved state can
    tell a resumed run."""

    plugin_name = "curriculum_learning"
    section = section("fixed_discrete", {"difficulty": [8, 32, 16], "max_step": [1, 2]}, 8, 32)
    steps = 4

    def make_engine(self, **kwargs):
        kwargs.setdefault("model", SeqlenModel())
        return super().make_engine(**kwargs)

    def trace(self, engine):
        return (engine.module.seen[-1], engine.curriculum_scheduler_legacy.get_current_difficulty())

    def check_trained(self, engine, losses):
        assert engine.module.seen == [8, 32, 32, 32]


# ------------------------------------------------------------------------------ config
def check_cli(capsys, path):
    code = cli_main(["config", "check", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_documented_example_passes_config_check(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "curriculum_learning": DOC_EXAMPLE}))
    code, out = check_cli(capsys, path)
    assert code == 0, out


@pytest.mark.parametrize("change,path,words", [
    ({"schedule_config": {"difficulty_step": 8}}, "curriculum_learning.schedule_config.total_curriculum_step",
     "required by schedule_type 'fixed_linear'"),
    ({"schedule_type": "fixed_root"}, "curriculum_learning.schedule_config.root_degree", "required"),
    ({"schedule_type": "fixed_lineer"}, "curriculum_learning.schedule_type", "did you mean 'fixed_linear'"),
    ({"curriculum_type": "seq_len"}, "curriculum_learning.curriculum_type", "'seqlen'"),
    ({"min_difficulty": 2048}, "curriculum_learning.min_difficulty", "above max_difficulty"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16], "max_step": [5, 10]}},
     "curriculum_learning.schedule_config.difficulty", "one more than max_step"),
    ({"schedule_config": {"total_curriculum_step": 0, "difficulty_step": 8}},
     "curriculum_learning.schedule_config.total_curriculum_step", ">= 1"),
    ({"max_difficulty": None}, "curriculum_learning.max_difficulty", "required when"),
    ({"schedule_config": {"total_curriculum_step": 10, "difficulty_stp": 8}},
     "curriculum_learning.schedule_config.difficulty_stp", "did you mean"),
])
def test_bad_config_names_the_key(change, path, words):
    bad = {k: v for k, v in {**DOC_EXAMPLE, **change}.items() if v is not None}
    error = check_config({"curriculum_learning": bad}, world_size=1)
    assert error is not None
    issues = {issue.path: issue.message for issue in error.issues}
    assert path in issues and words in issues[path], str(error)


# ------------------------------------------------------------------------------ dsplug train
def test_documented_example_trains_the_builtin_lm(tmp_path, capsys, monkeypatch, keep_threads):
    config = tmp_path / "curriculum.json"
    curriculum = dict(DOC_EXAMPLE, min_difficulty=8, max_difficulty=32,
                      schedule_config={"total_curriculum_step": 3, "difficulty_step": 8})
    config.write_text(json.dumps({**TRAIN_BASE, "curriculum_learning": curriculum}))
    seen = []
    forward = CharTransformer.forward

    def recording(self, tokens, **kwargs):
        out = forward(self, tokens, **kwargs)
        if self.training:
            seen.append((kwargs.get("curriculum_seqlen"), out.shape[1]))
        return out

    monkeypatch.setattr(CharTransformer, "forward", recording)
    code = cli_main(["train", "--config", str(config), "--steps", "4", "--output-dir", str(tmp_path / "out"), *TINY])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "done: 4 steps" in out.out and "nan" not in out.out.lower()
    # floor(s / 3 * 24 + 8) rounded down to a multiple of 8 for s = 1..4; logits of that many positions
    assert seen == [(16, 16), (24, 24), (32, 32), (32, 32)]

    # the documented example itself (seqlen 8 for its first 315 steps)
    config.write_text(json.dumps({**TRAIN_BASE, "curriculum_learning": DOC_EXAMPLE}))
    seen.clear()
    assert cli_main(["train", str(config), "--config", str(config), "--steps", "2",
                     "--output-dir", str(tmp_path / "doc"), *TINY]) == 0, capsys.readouterr().err
    assert seen == [(8, 8), (8, 8)]


def test_config_given_twice(tmp_path, capsys):
    other = tmp_path / "other.json"
    assert cli_main(["train", "a.json", "--config", str(other), "--output-dir", str(tmp_path / "out")]) == 2
    assert "the config is given twice" in capsys.readouterr().err

    class Args:
        config, config_file = None, "x.json"

    args = Args()
    resolve_config_option(args)
    assert args.config == "x.json"
