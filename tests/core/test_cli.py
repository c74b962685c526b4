"""The kernel's CLI: list, config check / explain, report."""
from __future__ import annotations

import json

import pytest

from dsplug.cli import main
from dsplug.plugins.zero.memory import model_state_bytes


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_table_and_json(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    assert out.splitlines()[0].split()[:4] == ["CATEGORY", "NAME", "DISTRIBUTION", "VERSION"]
    assert any(line.split()[:3] == ["accelerator", "cpu", "dsplug"] for line in out.splitlines())
    code, out, _ = run(capsys, "list", "--json", "--category", "precision")
    names = {p["name"] for p in json.loads(out)["plugins"]}
    assert names == {"fp32", "fp16", "bf16", "amp"}


def test_config_check_lists_every_error_and_exits_1(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                                "zero_optimization": {"overlap_com": True}, "fp16": {"enabled": "yes"}}))
    code, _, err = run(capsys, "config", "check", str(path), "--world-size", "2")
    assert code == 1
    assert f"{path}: 3 errors" in err
    assert "zero_optimization.overlap_com: unknown key; did you mean 'zero_optimization.overlap_comm'?" in err
    assert "fp16.enabled: 'yes' is not valid: expected a boolean" in err
    assert "train_batch_size=10 is not divisible by train_micro_batch_size_per_gpu=3 × world size 2" in err


def test_config_check_valid_and_legacy_warning(tmp_path, capsys):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"train_batch_size": 8, "bfloat16": {"enabled": True}}))
    code, out, err = run(capsys, "config", "check", str(path), "--world-size", "4")
    assert code == 0 and "valid for world size 4" in out
    assert 'write "bf16": {...} instead' in err


@pytest.mark.parametrize("stage,half,expected", [
    (0, True, 16.0), (1, True, 2 + 2 + 12 / 4), (2, True, 2 + 14 / 4), (3, True, 16 / 4),
    (0, False, 16.0), (1, False, 4 + 4 + 8 / 4), (2, False, 4 + 12 / 4), (3, False, 16 / 4),
])
def test_memory_formula_per_stage(stage, half, expected):
    psi = 1_000_000
    device = model_state_bytes(psi, 4, stage, half_precision=half)["device"]
    assert device["total"] == pytest.approx(expected * psi)


def test_memory_with_offload_moves_optimizer_states_to_host():
    mem = model_state_bytes(10**6, 2, 2, offload_optimizer=True)
    assert mem["device"]["optimizer_states"] == 0
    assert mem["host"]["optimizer_states"] == pytest.approx(12 * 10**6 / 2)


def test_config_explain_shows_plugins_and_memory(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}))
    code, out, _ = run(capsys, "config", "explain", str(path), "--world-size", "4", "--params", "1e6", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["config"]["train_batch_size"] == 8
    assert result["served_by"]["bf16"].startswith("precision:bf16 (dsplug")
    assert result["served_by"]["train_micro_batch_size_per_gpu"] == "kernel"
    assert result["memory_per_rank"]["device"]["total"] == pytest.approx(16e6)
    code, out, _ = run(capsys, "config", "explain", str(path), "--world-size", "4", "--params", "1e6")
    assert "model states per rank: 1,000,000 parameters, ZeRO stage 0, 16-bit mixed precision" in out


def test_report_runs(capsys):
    code, out, _ = run(capsys, "report")
    assert code == 0
    assert "accelerator      cpu (backend gloo" in out and "torch            2." in out


@pytest.mark.parametrize("argv, message", [
    (["trian"], "unknown command 'trian'; did you mean 'train'?"),
    (["lsit"], "unknown command 'lsit'; did you mean 'list'?"),
    (["config", "chek", "x.json"], "unknown command 'chek'; did you mean 'check'?"),
])
def test_a_mistyped_command_gets_a_did_you_mean(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "(commands: " in err


def test_an_unknown_command_with_no_close_match_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate' (commands: " in err and "did you mean" not in err
    assert "train" in err and "list" in err


def test_version(capsys):
    from dsplug import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"dsplug {__version__}\n"
