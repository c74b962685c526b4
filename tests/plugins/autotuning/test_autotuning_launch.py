"""``dsplug launch --autotuning tune|run`` for real: every experiment is a 2-process launch of a
small MLP script over gloo, measured inside the engine.

Timings on a shared machine are noisy, so the ranking is checked where the physics is not in
doubt (throughput at micro-batch 16 vs 1 on a model this small differs by about 10x) and against
the metrics recorded in the results directory.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import free_port, scaled
from tests.plugins.autotuning.test_autotuning import check_results_match_table, parse_table

SCRIPT = textwrap.dedent(
    """
    import argparse, json
    import torch
    import dsplug as deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(mbs, 64)
            loss = torch.nn.functional.mse_loss(engine(x), x[:, :1])
            engine.backward(loss)
            engine.step()
    if deepspeed.comm.get_rank() == 0:  # reached only by a run that was not ended by the autotuner
        with open(args.out, "w") as f:
            json.dump({"stage": engine.zero_optimization_stage(), "micro_batch": mbs,
                       "world": deepspeed.comm.get_world_size(), "steps": engine.global_steps}, f)
    """
)
PARAMS = 64 * 256 + 256 + 256 + 1  # the script's MLP


def _descendants(pid):
    """``pid`` and every process below it (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_everything(pid):
    """SIGKILL the tuning's process group and, since each experiment runs in a session of its own,
    every process below it and their groups."""
    procs = _descendants(pid)
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for g in groups | {pid}:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _autotune(tmp_path, mode, config, steps, launches):
    """``dsplug launch --autotuning MODE`` in a session of its own. ``launches``: how many runs the
    tuning may start (experiments, the model-info run, the final training); the limit is above
    their experiment timeouts together, and on reaching it (or on any interruption) the launcher's
    group and every process below it are killed (each experiment runs in a session of its own, so
    the group alone would not reach them): nothing outlives the test."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "dsplug.cli", "launch", "--num_procs", "2", "--master_port", str(free_port()),
               "--autotuning", mode, "train.py", "--deepspeed_config", "ds.json", "--steps", str(steps),
               "--out", "done.json"]
    limit = config["autotuning"]["experiment_timeout"] * launches + 60
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=scaled(limit))
    except BaseException:
        if proc.returncode is None:  # not reaped: its pid, the group's id, is still its own
            _kill_everything(proc.pid)
        out, err = proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_autotuning_finds_the_fastest_config_and_records_what_it_printed(tmp_path):
    config = {"train_micro_batch_size_per_gpu": [1, 16], "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              # ten measured steps: a stall of the loaded machine must last ~0.5 s to upset the ranking
              "autotuning": {"tuner_type": "gridsearch", "start_profile_step": 1, "end_profile_step": 10,
                             "experiment_timeout": 150}}
    done = _autotune(tmp_path, "tune", config, steps=50, launches=3)  # model info + 2
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    rows = check_results_match_table(results, exps, done.stdout, "throughput")
    assert list(rows) == ["z0_mbs16_gas1", "z0_mbs1_gas1"], done.stdout
    fast, slow = (json.loads((results / n / "metrics.json").read_text()) for n in rows)
    # 16x the samples per step at a similar step time on this small model: far more than noise
    assert fast["throughput"] > 2 * slow["throughput"], done.stdout
    for metrics, mbs in ((fast, 16), (slow, 1)):
        assert metrics["world_size"] == 2 and metrics["measured_steps"] == 10
        assert metrics["train_micro_batch_size_per_gpu"] == mbs and metrics["train_batch_size"] == 2 * mbs
        assert metrics["flops"] > 0
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 16 and "autotuning" not in optimal
    assert "--deepspeed_config autotuning_results/ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    # the model-info run: parameters, and the activations autograd keeps per sample: the input (64 values) and
    # the ReLU output (256 values, also the second layer's input), fp32
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] == PARAMS and info["activation_mem_per_sample"] == (64 + 256) * 4
    # experiments are ended by the engine after end_profile_step; tune never trains to the end
    for name in rows:
        assert "ending the run" in (results / name / "stdout.log").read_text()
    assert not (tmp_path / "done.json").exists()
    # the progress display: a line per experiment with its status
    assert any(line.startswith("[1/2] z0_mbs1_gas1") and " done " in line for line in done.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_autotuning_prunes_what_does_not_fit_keeps_the_budget_and_runs_the_best(tmp_path):
    # fp32 AdamW over 2 ranks, per rank: stage 0 16 P, stage 1 12 P, stage 2 10 P, stage 3 8 P bytes (ZeRO paper);
    # a fake budget of 9 P leaves stage 3 only
    config = {"train_micro_batch_size_per_gpu": [2, 4], "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "autotuning": {"tuner_type": "gridsearch", "tuner_num_trials": 1, "start_profile_step": 1,
                             "end_profile_step": 2, "model_info": {"num_params": PARAMS},
                             "device_memory": 9 * PARAMS, "experiment_timeout": 150}}
    done = _autotune(tmp_path, "run", config, steps=6, launches=2)  # 1 trial + the training
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    summary = json.loads((results / "summary.json").read_text())
    status = {e["name"]: e["status"] for e in summary["not_measured"]}
    assert status == {"z0_mbs2_gas1": "pruned", "z0_mbs4_gas1": "pruned", "z1_mbs2_gas1": "pruned",
                      "z1_mbs4_gas1": "pruned", "z2_mbs2_gas1": "pruned", "z2_mbs4_gas1": "pruned",
                      "z3_mbs4_gas1": "not run"}
    for name, per_param in (("z0_mbs2_gas1", 16), ("z1_mbs4_gas1", 12), ("z2_mbs2_gas1", 10)):
        result = json.loads((results / name / "result.json").read_text())
        assert result["memory_estimate"]["model_states"] == per_param * PARAMS
        assert not (results / name / "stdout.log").exists()  # never launched
    assert "tuner_num_trials reached (1 experiments)" in summary["stop_reason"]
    assert list(parse_table(done.stdout)) == ["z3_mbs2_gas1"] == [r["name"] for r in summary["ranking"]]
    # `run`: the training was launched with the optimal config and went to the end
    trained = json.loads((tmp_path / "done.json").read_text())
    assert trained == {"stage": 3, "micro_batch": 2, "world": 2, "steps": 6}
