"""contrib/dsplug-fsdp installs into a fresh environment as a third-party ZeRO stage ``fsdp2`` (PyTorch
FSDP2): ``dsplug list`` shows it, it imports no ``dsplug.plugins`` module, its own
ZeroStageContract tests pass there, and, run by that environment's python in real processes over
gloo (tests/contrib/fsdp_rank.py), it trains like dsplug's ZeRO stage 3 (AdamW, WarmupLR,
gradient accumulation, clipping, fp32 / bf16 / fp16), resumes exactly in fresh processes, reloads
a 2-rank checkpoint in 1 rank, and refuses what it does not do with errors naming the key."""
from __future__ import annotations

import ast
import json
import os
import site
import subprocess
import sysconfig
import venv

import pytest
import torch

from tests.conftest import REPO, free_port, scaled

FSDP = REPO / "contrib" / "dsplug-fsdp"
RANK_SCRIPT = REPO / "tests" / "contrib" / "fsdp_rank.py"


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """A new venv that sees this environment's packages (torch, dsplug) through a .pth file, with
    dsplug-fsdp pip-installed into it (and nowhere else)."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    outer = [sysconfig.get_paths()["purelib"]] + site.getsitepackages()
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(outer))
    with open(os.path.join(purelib, "outer_env.pth"), "w") as f:
        f.write(lines)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(FSDP)],
                   check=True, capture_output=True)
    return python


def run_ranks(python, world_size: int, args: dict, out_dir, name: str, timeout: float = 300.0):
    """``world_size`` processes of fsdp_rank.py under ``python`` (gloo on 127.0.0.1); their results."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = out_dir / f"{name}.rank{rank}.log"
        logs.append(log)
        mine = dict(args, out=str(out_dir / f"{name}.rank{rank}.pt"))
        with open(log, "wb") as f:
            procs.append(subprocess.Popen([str(python), str(RANK_SCRIPT), json.dumps(mine)], env=env, stdout=f,
                                          stderr=subprocess.STDOUT, cwd=out_dir))
    try:
        codes = [p.wait(timeout=scaled(timeout)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, code in enumerate(codes):
        assert code == 0, f"{name} rank {rank} exited with {code}:\n{logs[rank].read_text()[-3000:]}"
    return [torch.load(out_dir / f"{name}.rank{r}.pt", weights_only=False) for r in range(world_size)]


# ------------------------------------------------------------------------------ the distribution
def test_the_distribution_uses_public_contracts_only():
    offenders = []
    for path in FSDP.rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(FSDP)}: import {n}" for n in names if n.startswith("dsplug.plugins")]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "dsplug.plugins" in node.value:
                offenders.append(f"{path.relative_to(FSDP)}: string {node.value[:60]!r}")  # importlib, entry points
    assert offenders == []
    assert "dsplug_fsdp.plugin" in (FSDP / "pyproject.toml").read_text()


def test_dsplug_list_reports_the_fsdp2_stage(fresh_env):
    out = subprocess.run([fresh_env, "-m", "dsplug.cli", "list", "--json", "--category", "zero_stage"],
                         capture_output=True, text=True, check=True).stdout
    rows = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert (rows["fsdp2"]["distribution"], rows["fsdp2"]["entry_point"]) == ("dsplug-fsdp", "fsdp2")
    assert rows["3"]["distribution"] == "dsplug"


def test_fsdp2_passes_its_own_contract_tests(fresh_env, tmp_path):
    done = subprocess.run([fresh_env, "-m", "pytest", str(FSDP / "tests"), "-q", "-p", "no:cacheprovider",
                           "--basetemp", str(tmp_path / "pytest")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


# ------------------------------------------------------------------------------ against ZeRO stage 3
#: (losses rtol, weights / optimizer state atol) against stage 3. fp32 and bf16 differ only in the
#: order of fp32 sums (stage 3 reduces each micro-step's gradient into its own flat partition);
#: fp16's forward amplifies those last-bit differences through the fp16 weights.
TOLERANCE = {None: (1e-5, 1e-5), "bf16": (1e-5, 1e-5), "fp16": (1e-3, 1e-3)}


@pytest.mark.slow  # real processes: ~20-60 s each on 2 cores
@pytest.mark.parametrize("precision", [None, "bf16", "fp16"])
def test_losses_equal_zero_stage_3_on_two_ranks(fresh_env, tmp_path, precision):
    steps = 6
    monitor = tmp_path / "monitor"
    fsdp = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": steps, "precision": precision,
                                    "monitor_dir": str(monitor)}, tmp_path, "fsdp2")
    zero3 = run_ranks(fresh_env, 2, {"stage": 3, "steps": steps, "precision": precision}, tmp_path, "stage3")
    rtol, atol = TOLERANCE[precision]
    for step, (a, b) in enumerate(zip(fsdp[0]["losses"], zero3[0]["losses"])):  # (shown with -s)
        print(f"{precision or 'fp32'} step {step}: fsdp2 {a:.9f}  stage 3 {b:.9f}  diff {abs(a - b):.2e}")
    for rank in range(2):
        got, want = fsdp[rank], zero3[rank]
        assert got["zero_stage"] == 3  # engine.zero_optimization_stage(): partitions parameters
        torch.testing.assert_close(got["losses"], want["losses"], rtol=rtol, atol=0)
        assert got["lrs"] == want["lrs"] and got["skipped"] == want["skipped"]
        norms = [(a, b) for a, b in zip(got["grad_norms"], want["grad_norms"]) if b == b]  # (fp16: nan when skipped)
        torch.testing.assert_close([a for a, _ in norms], [b for _, b in norms], rtol=10 * rtol, atol=0)
        assert all(b > 0.5 for _, b in norms), "gradient_clipping 0.5 was never exercised"
        for name, value in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=atol, msg=name)
        for name, states in want["optimizer"].items():
            for key, value in states.items():
                torch.testing.assert_close(got["optimizer"][name][key], value, rtol=0, atol=atol,
                                           msg=f"{name} {key}")
        for name, value in want["first_grads"].items():  # (fp16: still multiplied by the loss scale)
            torch.testing.assert_close(got["first_grads"][name], value, rtol=1e-5, atol=1e-6, equal_nan=True,
                                       msg=name)
    if precision == "fp16":
        assert fsdp[0]["skipped"][0] >= 1  # the loss scale starts too high: overflows were skipped
    # the csv monitor wrote every step's loss
    rows = (monitor / "fsdp" / "Train_Samples_train_loss.csv").read_text().strip().splitlines()
    assert len(rows) == steps + 1


# ------------------------------------------------------------------------------ checkpoints
@pytest.mark.slow  # real processes: ~20-60 s each on 2 cores
def test_resume_in_fresh_processes_equals_the_uninterrupted_run(fresh_env, tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": 6}, tmp_path, "whole")
    first = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": 6, "save_dir": str(ckpt), "save_at": 3,
                                     "stop_after_save": True}, tmp_path, "first")
    second = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": 6, "save_dir": str(ckpt), "load_tag": "step3"},
                       tmp_path, "second")
    for rank in range(2):
        assert second[rank]["start_step"] == 3
        assert first[rank]["losses"] + second[rank]["losses"] == whole[rank]["losses"]  # bit for bit
        assert first[rank]["lrs"] + second[rank]["lrs"] == whole[rank]["lrs"]
        for name, value in whole[rank]["weights"].items():
            assert torch.equal(second[rank]["weights"][name], value), name
        for name, states in whole[rank]["optimizer"].items():
            for key, value in states.items():
                assert torch.equal(second[rank]["optimizer"][name][key], value), (name, key)


@pytest.mark.slow  # real processes: ~20-60 s each on 2 cores
def test_a_two_rank_checkpoint_loads_in_one_rank(fresh_env, tmp_path):
    """bf16: the fp32 master rows and Adam's moments of both ranks are joined and cut again."""
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": 3, "precision": "bf16", "save_dir": str(ckpt),
                                     "save_at": 3}, tmp_path, "two")[0]
    loaded = run_ranks(fresh_env, 1, {"stage": "fsdp2", "steps": 3, "precision": "bf16", "save_dir": str(ckpt),
                                      "load_tag": "step3"}, tmp_path, "one")[0]
    assert loaded["world_size"] == 1 and loaded["start_step"] == 3
    for name, value in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], value), name
    for name, states in saved["saved_optimizer"].items():
        for key, value in states.items():
            assert torch.equal(loaded["optimizer"][name][key], value), (name, key)


# ------------------------------------------------------------------------------ what it refuses
REFUSED = [
    ({"zero_optimization": {"stage": "fsdp2", "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device: 'cpu' needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is fsdp2"),
    ({"zero_optimization": {"stage": "fsdp2", "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param: offloading parameters needs stage 3 (zero_optimization.stage is fsdp2)"),
    ({"zero_optimization": {"stage": "fsdp2"}, "data_types": {"grad_accum_dtype": "bf16"}},
     "data_types.grad_accum_dtype: 'bf16': the ZeRO stage 'fsdp2' accumulates gradients in the fp32 shards"),
    ({"zero_optimization": {"stage": "fsdp2"}, "amp": {"enabled": True}},
     "amp.enabled: amp cannot be combined with ZeRO (zero_optimization.stage is fsdp2)"),
    ({"zero_optimization": {"stage": "fsdp2", "zero_quantized_gradients": True}},
     "zero_optimization.zero_quantized_gradients: ZeRO++ (zero_quantized_gradients) needs ZeRO stage 3"),
    ({"zero_optimization": {"stage": 3, "wrap": ["Block"]}},
     "zero_optimization.wrap: is a key of the zero_stage 'fsdp2', which this config does not select "
     "(zero_optimization.stage selects '3')"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=[m.split(":")[0] for _, m in REFUSED])
def test_an_unsupported_combination_is_a_config_error_naming_the_key(fresh_env, tmp_path, extra, message):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, **extra}))
    done = subprocess.run([fresh_env, "-m", "dsplug.cli", "config", "check", str(path)], capture_output=True,
                          text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in done.stderr


def test_knobs_of_dsplugs_own_stages_are_accepted_with_a_notice(fresh_env, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {
        "stage": "fsdp2", "stage3_prefetch_bucket_size": 1000, "reduce_scatter": False}}))
    done = subprocess.run([fresh_env, "-m", "dsplug.cli", "config", "check", str(path)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert "zero_optimization.stage3_prefetch_bucket_size: has no effect with the ZeRO stage 'fsdp2'" in done.stderr
    assert "reduce_scatter" not in done.stderr  # honoured: an all-reduce instead of the reduce-scatter


@pytest.mark.slow  # real processes: ~20-60 s each on 2 cores
def test_all_reduce_and_prescaled_reductions_train_like_the_default(fresh_env, tmp_path):
    """zero_optimization.reduce_scatter false (all-reduce, keep this rank's rows) and
    prescale_gradients (divide before the sum) average the same gradients."""
    default = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": 3}, tmp_path, "default")
    other = run_ranks(fresh_env, 2, {"stage": "fsdp2", "steps": 3, "extra": {
        "zero_optimization": {"reduce_scatter": False}, "prescale_gradients": True}}, tmp_path, "allreduce")
    for rank in range(2):
        torch.testing.assert_close(other[rank]["losses"], default[rank]["losses"], rtol=1e-6, atol=0)
        for name, value in default[rank]["weights"].items():
            torch.testing.assert_close(other[rank]["weights"][name], value, rtol=0, atol=1e-6, msg=name)
