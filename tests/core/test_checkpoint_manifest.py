"""Manifests: a dsplug tag without one is refused, a DeepSpeed one loads with one warning, and
``dsplug checkpoint verify`` reads nothing outside what it checks, for any manifest shape."""
from __future__ import annotations

import builtins
import contextlib
import importlib.util
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsplug
from dsplug.checkpoint import CheckpointError
from tests.engine_common import batch, loss_fn, make_model

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _engine(config=CONFIG):
    return dsplug.initialize(model=make_model(), config=config)[0]


def _saved(save_dir, tag="t", config=CONFIG):
    engine = _engine(config)
    for step in range(2):
        x, y = batch(step, 0, 0, 2)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(save_dir, tag=tag)
    return engine


def _flip(path, count=16):
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[len(data) // 2 + i] ^= 0x5A
    path.write_bytes(bytes(data))


def _verify(*args):
    from dsplug.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["checkpoint", "verify", *map(str, args)])
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------ loading
def test_a_dsplug_tag_without_its_manifest_is_refused_naming_the_file(tmp_path, capsys):
    """The issue's case: the manifest deleted and 16 bytes of an optimizer shard flipped."""
    _saved(tmp_path)
    (tmp_path / "t" / "manifest.json").unlink()
    _flip(tmp_path / "t" / SHARD)
    with pytest.raises(CheckpointError, match=rf"written by dsplug but {tmp_path / 't' / 'manifest.json'} is missing"):
        _engine().load_checkpoint(tmp_path, tag="t")
    # recognised by its model file too when the tag's other files were moved away
    for name in os.listdir(tmp_path / "t"):
        if name.startswith("rng_state"):
            (tmp_path / "t" / name).unlink()
    with pytest.raises(CheckpointError, match="written by dsplug but .*manifest.json is missing"):
        _engine().load_checkpoint(tmp_path, tag="t")


def test_the_opt_out_loads_a_tag_without_manifest_with_a_warning(tmp_path, capsys):
    saved = _saved(tmp_path)
    (tmp_path / "t" / "manifest.json").unlink()
    engine = _engine({**CONFIG, "checkpoint": {"require_manifest": False}})
    path, _ = engine.load_checkpoint(tmp_path, tag="t")
    assert path == str(tmp_path / "t")
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), saved.module.parameters()))
    out = capsys.readouterr().out
    assert f"{tmp_path / 't' / 'manifest.json'} is missing; loading {tmp_path / 't'} unverified" in out, out


def _deepspeed_engine(name):
    spec = importlib.util.spec_from_file_location("deepspeed_fixtures", DATA / "make_fixtures.py")
    fx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fx)
    stage, bf16, _ = fx.FIXTURES[name]
    return dsplug.initialize(model=fx.make_model(), config=fx.config(stage, bf16, 1))[0]


@pytest.mark.parametrize("name", ["s0_fp32_w1", "s2_fp32_w2"])
def test_a_deepspeed_checkpoint_loads_with_one_warning_that_it_is_unverified(name, tmp_path, capsys):
    shutil.copytree(DATA / name, tmp_path / name)
    engine = _deepspeed_engine(name)
    capsys.readouterr()
    path, _ = engine.load_checkpoint(tmp_path / name)
    assert path is not None and engine.global_steps == 3
    out = capsys.readouterr().out
    assert out.count("unverified") == 1 and "written by DeepSpeed" in out, out


# ------------------------------------------------------------------------------ verify
def test_verify_reports_entries_outside_the_tag_without_reading_them(tmp_path, monkeypatch):
    _saved(tmp_path / "ckpt")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    tag = tmp_path / "ckpt" / "t"
    os.symlink(secret, tag / "link")
    manifest = json.loads((tag / "manifest.json").read_text())
    entry = {"sha256": "0" * 64, "bytes": 9}
    manifest["files"].update({str(secret): entry, "../../secret.txt": entry, "link": entry, "text": "a string",
                              "n": 3, "nested": {"bytes": "x"}})
    (tag / "manifest.json").write_text(json.dumps(manifest))
    opened = _record_opens(monkeypatch)
    code, out, err = _verify(tag)
    assert code == 1 and "Traceback" not in out + err
    assert "is not a plain file name inside the tag directory; not read" in out
    assert f"outside {tag}; not read" in out and "9 bytes" not in out
    assert not [p for p in opened if (p.startswith(str(tmp_path)) or p.startswith("/etc"))
                and not p.startswith(str(tag))], opened


def _record_opens(monkeypatch):
    opened = []
    real_open, real_os_open = builtins.open, os.open

    def recording_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            opened.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *args, **kwargs)

    def recording_os_open(path, *args, **kwargs):
        opened.append(os.path.realpath(os.fsdecode(path)))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(os, "open", recording_os_open)
    return opened


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                     max_leaves=12)
_names = st.sampled_from(["mp_rank_00_model_states.pt", "../secret.txt", "/etc/passwd", "", ".", "..", "a/b",
                          "link", "nul\x00", "manifest.json"]) | st.text(max_size=20)
_entries = _json | st.fixed_dictionaries({"sha256": st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
                                          | _json, "bytes": st.integers(-5, 10 ** 12) | _json})
_manifests = (_json | st.fixed_dictionaries({"files": st.dictionaries(_names, _entries, max_size=5) | _json},
                                            optional={"save_dir_files": st.dictionaries(_names, _entries, max_size=3)
                                                      | _json, "format": _json}))
_raw = st.one_of(_manifests.map(lambda m: json.dumps(m).encode()), st.binary(max_size=64),
                 st.just(b"[" * 100000), st.just(b'{"files": ' + b"[" * 5000 + b"]" * 5000 + b"}"))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=_raw)
def test_verify_never_gives_a_traceback_nor_reads_outside_for_any_manifest(tmp_path_factory, raw):
    root = tmp_path_factory.mktemp("fuzz")
    save_dir, tag = root / "ckpt", root / "ckpt" / "t"
    tag.mkdir(parents=True)
    (root / "secret.txt").write_text("not yours")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    os.symlink(root / "secret.txt", tag / "link")
    (tag / "manifest.json").write_bytes(raw)
    (save_dir / "latest").write_text("t")
    (save_dir / "zero_to_fp32.py").write_text("print()")
    opened = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            opened.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *args, **kwargs)

    builtins.open = recording_open
    try:
        for args, allowed in (((tag,), tag), ((save_dir,), save_dir), ((save_dir, "--all"), save_dir)):
            opened.clear()
            code, out, err = _verify(*args)
            assert code in (0, 1) and "Traceback" not in out + err
            # (the CLI itself reads its modules and entry points: only the checkpoint's neighbourhood counts)
            outside = [p for p in opened if (p.startswith(str(root) + os.sep) or p.startswith("/etc"))
                       and not p.startswith(str(allowed) + os.sep)]
            assert not outside, (args, outside)
    finally:
        builtins.open = real_open


def test_zero_to_fp32_is_in_the_manifest_and_verified(tmp_path):
    config = {**CONFIG, "zero_optimization": {"stage": 2}}
    _saved(tmp_path, config=config)
    script = tmp_path / "zero_to_fp32.py"
    assert script.is_file()
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    import hashlib

    data = script.read_bytes()
    assert manifest["save_dir_files"] == {"zero_to_fp32.py": {"sha256": hashlib.sha256(data).hexdigest(),
                                                              "bytes": len(data)}}
    code, out, _ = _verify(tmp_path)
    assert code == 0 and f"OK     {tmp_path} (zero_to_fp32.py)" in out, out
    script.write_bytes(data.replace(b"def ", b"def  ", 1))
    code, out, _ = _verify(tmp_path)
    assert code == 1 and f"{script} has {len(data) + 1} bytes but its manifest says {len(data)}" in out, out
