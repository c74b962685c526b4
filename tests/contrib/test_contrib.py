"""contrib/ distributions install into a fresh environment as third-party plugins: dsplug-lion (an
optimizer) and dsplug-jsonl-monitor (a monitor with checkpointed state, built on the public
contracts and tested with dsplug.testing)."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import venv

import pytest
import torch

from tests.conftest import REPO


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """A new venv that sees this environment's packages (torch, dsplug) but not its plugins' files."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    outer = [sysconfig.get_paths()["purelib"]] + site.getsitepackages()
    # site.addsitedir also runs the outer .pth files (an editable dsplug install lives in one)
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(outer))
    with open(os.path.join(purelib, "outer_env.pth"), "w") as f:
        f.write(lines)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    str(REPO / "contrib" / "dsplug-lion"), str(REPO / "contrib" / "dsplug-jsonl-monitor")],
                   check=True, capture_output=True)
    return python


def test_dsplug_list_reports_the_contrib_distribution(fresh_env):
    out = subprocess.run([fresh_env, "-m", "dsplug.cli", "list", "--json"], capture_output=True, text=True,
                         check=True).stdout
    rows = {(p["category"], p["name"]): p for p in json.loads(out)["plugins"]}
    lion = rows[("optimizer", "Lion")]
    assert (lion["distribution"], lion["version"], lion["entry_point"]) == ("dsplug-lion", "0.1.0", "lion")
    assert rows[("accelerator", "cpu")]["distribution"] == "dsplug"
    # ... and it is not visible from the outer environment, where it was never installed
    outer = subprocess.run([sys.executable, "-m", "dsplug.cli", "list", "--json"], capture_output=True,
                           text=True, check=True).stdout
    assert ("optimizer", "Lion") not in {(p["category"], p["name"]) for p in json.loads(outer)["plugins"]}


def test_config_selecting_the_contrib_plugin_passes_check(fresh_env, tmp_path):
    good = tmp_path / "lion.json"
    good.write_text(json.dumps({"train_batch_size": 8,
                                "optimizer": {"type": "lion", "params": {"lr": 3e-4, "betas": [0.9, 0.99]}}}))
    done = subprocess.run([fresh_env, "-m", "dsplug.cli", "config", "check", str(good)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "Lion", "params": {"beta": [0.9, 0.9]}}}))
    done = subprocess.run([fresh_env, "-m", "dsplug.cli", "config", "check", str(bad)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "optimizer.params.beta: unknown key; did you mean 'optimizer.params.betas'?" in done.stderr


def test_lion_matches_its_formula():
    sys.path.insert(0, str(REPO / "contrib" / "dsplug-lion"))
    try:
        from dsplug_lion.lion import Lion
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7))
    ref_p, m = p.detach().clone(), torch.zeros(7)
    opt = Lion([p], lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(7)
        p.grad = g.clone()
        opt.step()
        ref_p = ref_p * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.8 * m + 0.2 * g)
        m = 0.95 * m + 0.05 * g
    torch.testing.assert_close(p.detach(), ref_p)


# ------------------------------------------------------------------------------ dsplug-jsonl-monitor
JSONL = REPO / "contrib" / "dsplug-jsonl-monitor"


def test_dsplug_list_reports_the_jsonl_monitor(fresh_env):
    out = subprocess.run([fresh_env, "-m", "dsplug.cli", "list", "--json", "--category", "monitor"],
                         capture_output=True, text=True, check=True).stdout
    rows = {p["name"]: p for p in json.loads(out)["plugins"]}
    row = rows["jsonl_monitor"]
    assert (row["distribution"], row["version"], row["entry_point"], row["section"], row["module"]) == \
        ("dsplug-jsonl-monitor", "0.1.0", "jsonl_monitor", "jsonl_monitor", "dsplug_jsonl_monitor.plugin")
    assert rows["csv_monitor"]["distribution"] == "dsplug"


RESUME_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from dsplug.testing import tiny_engine, train_steps

    out = sys.argv[1]

    def config(job):
        return {"jsonl_monitor": {"enabled": True, "output_path": out, "job_name": job, "ema_beta": 0.8}}

    def monitor(engine):
        return next(o for o in engine.observers if type(o).__name__ == "JsonlMonitor")

    whole = tiny_engine(config("whole"))
    train_steps(whole, 4)
    want = monitor(whole).state_dict()
    whole.destroy()

    first = tiny_engine(config("resumed"))
    train_steps(first, 2)
    first.save_checkpoint(os.path.join(out, "ckpt"), tag="t")
    saved = monitor(first).state_dict()
    first.destroy()
    shared = torch.load(os.path.join(out, "ckpt", "t", "mp_rank_00_model_states.pt"), weights_only=True)

    fresh = tiny_engine(config("resumed"))
    fresh.load_checkpoint(os.path.join(out, "ckpt"), tag="t")
    loaded = monitor(fresh).state_dict()
    train_steps(fresh, 2)
    got = monitor(fresh).state_dict()
    fresh.destroy()
    with open(os.path.join(out, "resumed", "events.jsonl")) as f:
        lines = sum(1 for _ in f)
    print(json.dumps({"want": want, "saved": saved, "in_checkpoint": shared["jsonl_monitor.state"],
                      "loaded": loaded, "got": got, "lines": lines}))
""")


def test_jsonl_monitor_trains_and_its_state_survives_a_checkpoint(fresh_env, tmp_path):
    done = subprocess.run([fresh_env, "-c", RESUME_SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    saved = result["saved"]
    assert saved["steps_seen"] == 2 and saved["events_written"] > 0 and saved["loss_ema"] is not None
    assert result["in_checkpoint"] == saved  # contributed through dsplug_checkpoint_state, no kernel change
    assert result["loaded"] == saved  # restored in a fresh engine
    assert result["got"] == result["want"]  # the resumed run continues EMA, best loss and counts exactly
    assert result["lines"] == result["got"]["events_written"]  # one file, appended across the restart


def test_jsonl_monitor_passes_its_own_contract_tests(fresh_env, tmp_path):
    done = subprocess.run([fresh_env, "-m", "pytest", str(JSONL / "tests"), "-q", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "pytest")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
