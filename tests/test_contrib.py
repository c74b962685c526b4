"""contrib/dsplug-lion installs into a fresh environment as a third-party plugin distribution."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch

from .conftest import REPO


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
                    str(REPO / "contrib" / "dsplug-lion")], check=True, capture_output=True)
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
