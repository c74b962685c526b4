"""contrib/dsplug-mmap-offload installs into a fresh environment as a third-party offload device:
``dsplug list`` shows it, its own OffloadDeviceContract tests pass there, it imports no
``dsplug.plugins`` module, and ZeRO training with it equals ``"device": "cpu"`` bit for bit
(stage 3 with parameters and optimizer offloaded, stage 2 with the optimizer offloaded)."""
from __future__ import annotations

import ast
import json
import os
import site
import subprocess
import sysconfig
import textwrap
import venv

import pytest

from tests.conftest import REPO

MMAP = REPO / "contrib" / "dsplug-mmap-offload"


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """A new venv that sees this environment's packages (torch, dsplug) through a .pth file, with
    dsplug-mmap-offload pip-installed into it (and nowhere else)."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    outer = [sysconfig.get_paths()["purelib"]] + site.getsitepackages()
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(outer))
    with open(os.path.join(purelib, "outer_env.pth"), "w") as f:
        f.write(lines)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(MMAP)],
                   check=True, capture_output=True)
    return python


def test_the_distribution_uses_public_contracts_only():
    offenders = []
    for path in MMAP.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(MMAP)}: {n}" for n in names if n.startswith("dsplug.plugins")]
    assert offenders == []


def test_dsplug_list_reports_the_mmap_device(fresh_env):
    out = subprocess.run([fresh_env, "-m", "dsplug.cli", "list", "--json", "--category", "offload_device"],
                         capture_output=True, text=True, check=True).stdout
    rows = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert (rows["mmap"]["distribution"], rows["mmap"]["entry_point"]) == ("dsplug-mmap-offload", "mmap_offload")
    assert rows["cpu"]["distribution"] == "dsplug"


def test_mmap_passes_its_own_contract_tests(fresh_env, tmp_path):
    done = subprocess.run([fresh_env, "-m", "pytest", str(MMAP / "tests"), "-q", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "pytest")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


BIT_FOR_BIT = textwrap.dedent("""
    import json, os, sys
    import torch
    import dsplug

    out = sys.argv[1]

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 8))

    def run(stage, device, precision):
        zero = {"stage": stage, "offload_optimizer": {"device": device, "nvme_path": out}}
        if stage == 3:
            zero["offload_param"] = {"device": device, "nvme_path": out}
            zero["stage3_param_persistence_threshold"] = 0
        config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
                  "gradient_clipping": 1.0}
        if precision:
            config[precision] = {"enabled": True}
        engine, *_ = dsplug.initialize(model=model(), config=config)
        dtype = engine.precision.model_dtype or torch.float32
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            for micro in range(2):
                x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
                loss = ((engine(x.to(dtype)).float() - y) ** 2).mean()
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        weights = {k: v.float().tolist() for k, v in engine.stage.module_state_dict().items()}
        files = [f for _, _, fs in os.walk(out) for f in fs]
        engine.destroy()
        return {"losses": losses, "weights": weights, "files_while_training": len(files)}

    result = {}
    for stage in (3, 2):
        for precision in (None, "bf16"):
            key = f"stage{stage}-{precision or 'fp32'}"
            result[key] = {d: run(stage, d, precision) for d in ("mmap", "cpu")}
    print(json.dumps(result))
""")


def test_training_with_mmap_equals_cpu_bit_for_bit(fresh_env, tmp_path):
    done = subprocess.run([fresh_env, "-c", BIT_FOR_BIT, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == {"stage3-fp32", "stage3-bf16", "stage2-fp32", "stage2-bf16"}
    for case, runs in result.items():
        mmap, cpu = runs["mmap"], runs["cpu"]
        assert mmap["losses"] == cpu["losses"], case  # floats from .item(): exact equality
        assert mmap["weights"] == cpu["weights"], case
        assert mmap["files_while_training"] > 0 and cpu["files_while_training"] == 0, case
    assert os.listdir(tmp_path) == []  # destroy() removed the mmap files
