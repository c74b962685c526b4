"""Autotuning without subprocesses: the ``autotuning`` section, the tuning space, the tuners and
their budget, the measuring observer inside a real engine, and the whole tuning driven through a
stand-in experiment runner (the real ``dsplug launch`` experiments are in
``test_autotuning_launch.py``)."""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import signal
import time

import pytest
import torch

import dsplug
from dsplug.config import ConfigError, DsplugConfig
from dsplug.config.schema import parse, to_dict
from dsplug.plugins.autotuning.autotuner import PROFILE_RUN, Autotuner, run_autotuning
from dsplug.plugins.autotuning.config import AutotuningConfig
from dsplug.plugins.autotuning.observer import write_json_atomic
from dsplug.plugins.autotuning.space import (AutotuningError, Candidate, batch_for, find_config_arg,
                                             geometric_sizes, read_space, with_config_arg, with_mapped_args)
from dsplug.plugins.autotuning.tuner import (Budget, GridSearchTuner, ModelBasedTuner, RandomTuner, explore,
                                             ridge_fit)
from dsplug.testing import ObserverContract, tiny_engine, train_steps
from tests.conftest import scaled

# the reference's documented keys and defaults (DeepSpeed config JSON reference, "Autotuning")
DOCUMENTED = {"enabled": False, "results_dir": "autotuning_results", "exps_dir": "autotuning_exps",
              "overwrite": False, "metric": "throughput", "start_profile_step": 3, "end_profile_step": 5,
              "fast": True, "max_train_batch_size": None, "mp_size": 1, "num_tuning_micro_batch_sizes": 3,
              "tuner_type": "model_based", "tuner_early_stopping": 5, "tuner_num_trials": 50, "arg_mappings": None,
              "num_nodes": None, "num_gpus": None}


# ----------------------------------------------------------------------------- the section
def test_section_has_deepspeeds_keys_and_defaults():
    parsed = to_dict(parse(AutotuningConfig, {}))
    assert {k: parsed[k] for k in DOCUMENTED} == DOCUMENTED
    assert parsed["min_train_micro_batch_size_per_gpu"] == 1 and parsed["max_train_micro_batch_size_per_gpu"] == 1024
    given = {"enabled": True, "metric": "FLOPS", "tuner_type": "Random", "fast": False,
             "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"},
             "model_info": {"num_params": 1000}}
    parsed = to_dict(parse(AutotuningConfig, given))
    assert parsed["metric"] == "flops" and parsed["tuner_type"] == "random"  # canonical spelling
    assert parsed["model_info"]["num_params"] == 1000
    DsplugConfig({"train_batch_size": 4, "autotuning": given})  # the section is owned: the whole config checks


@pytest.mark.parametrize("section,path,message", [
    ({"tuner_typ": "random"}, "autotuning.tuner_typ", "did you mean 'autotuning.tuner_type'"),
    ({"metric": "speed"}, "autotuning.metric", "latency"),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type", "gridsearch"),
    ({"start_profile_step": 6, "end_profile_step": 5}, "autotuning.end_profile_step", "less than start_profile_step"),
    ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
     "autotuning.min_train_micro_batch_size_per_gpu", "larger than max"),
    ({"min_train_batch_size": 64, "max_train_batch_size": 8}, "autotuning.min_train_batch_size", "larger than"),
    ({"tuner_num_trials": 0}, "autotuning.tuner_num_trials", ">= 1"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "batch"}}, "autotuning.arg_mappings", "not a command-line"),
    ({"model_info": {"num_param": 5}}, "autotuning.model_info.num_param", "did you mean"),
    ({"results_dir": " "}, "autotuning.results_dir", "non-empty"),
])
def test_section_errors_name_the_key(section, path, message):
    with pytest.raises(ConfigError) as err:
        DsplugConfig({"train_batch_size": 4, "autotuning": section})
    text = str(err.value)
    assert path in text and message in text, text


def test_model_info_profile_needs_a_path():
    with pytest.raises(ConfigError, match=r"autotuning.model_info_path: is not set but model_info.profile is true"):
        DsplugConfig({"train_batch_size": 2, "autotuning": {"enabled": True, "model_info": {"profile": True}}})


# ----------------------------------------------------------------------------- the space
def test_space_from_the_users_config():
    space = read_space({"train_micro_batch_size_per_gpu": [16, 1, 4, 4], "zero_optimization": {"stage": [3, 0]}},
                       fast=True)
    assert space.stages == [0, 3] and space.micro_batches == [1, 4, 16]
    space = read_space({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "all"}}, fast=True)
    assert space.stages == [0, 1, 2, 3] and space.micro_batches is None
    assert read_space({"zero_optimization": {"stage": 2}}, fast=True).stages == [2]
    assert read_space({}, fast=True).stages == [0, 1, 2, 3]
    space = read_space({"zero_optimization": {"stage": 2, "reduce_bucket_size": [10, 20], "overlap_comm": True}},
                       fast=False)
    assert space.knob_lists == {"reduce_bucket_size": [10, 20]} and space.knob_fixed == {"overlap_comm": True}
    with pytest.raises(AutotuningError, match=r"zero_optimization.reduce_bucket_size is a list .*fast"):
        read_space({"zero_optimization": {"reduce_bucket_size": [10, 20]}}, fast=True)
    with pytest.raises(AutotuningError, match="zero_optimization.stage"):
        read_space({"zero_optimization": {"stage": 4}}, fast=True)
    with pytest.raises(AutotuningError, match="train_micro_batch_size_per_gpu"):
        read_space({"train_micro_batch_size_per_gpu": [0, 2]}, fast=True)


def test_geometric_sizes_span_the_range_on_a_log_scale():
    assert geometric_sizes(1, 1024, 3) == [1, 32, 1024]
    assert geometric_sizes(1, 16, 5) == [1, 2, 4, 8, 16]
    assert geometric_sizes(4, 4, 3) == [4]
    assert geometric_sizes(8, 4, 3) == []
    for lo, hi, n in [(1, 1000, 7), (3, 77, 4), (2, 5, 10)]:
        sizes = geometric_sizes(lo, hi, n)
        assert sizes[0] == lo and sizes[-1] == hi and sizes == sorted(set(sizes)) and len(sizes) <= n


def test_batch_triple_per_micro_batch():
    space = read_space({"train_batch_size": 32}, fast=True)
    assert batch_for(space, 4, 2) == ((4, 32), None)  # gas = 32 / (4 x 2)
    assert batch_for(space, 3, 2)[0] is None and "not a multiple" in batch_for(space, 3, 2)[1]
    space = read_space({"gradient_accumulation_steps": 2}, fast=True)
    assert batch_for(space, 4, 2) == ((2, 16), None)


def test_config_argument_forms_and_arg_mappings():
    assert find_config_arg(["--x", "1", "--deepspeed_config", "a.json"]) == (3, "a.json")
    assert find_config_arg(["--deepspeed_config=a.json"]) == (0, "a.json")
    assert find_config_arg(["--deepspeed", "--deepspeed_config", "b.json"]) == (2, "b.json")
    assert find_config_arg(["--deepspeed", "hf.json", "--lr", "1"]) == (1, "hf.json")
    with pytest.raises(AutotuningError, match="--deepspeed_config FILE"):
        find_config_arg(["--deepspeed", "--lr", "1"])
    assert with_config_arg(["--deepspeed_config=a.json", "--n", "2"], 0, "/x/c.json") == ["--deepspeed_config=/x/c.json",
                                                                                           "--n", "2"]
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}
    args = with_mapped_args(["--bs", "1", "--other", "x"],
                            {"train_micro_batch_size_per_gpu": "--bs", "zero_optimization.stage": "--zero"}, cfg)
    assert args == ["--bs", "8", "--other", "x", "--zero", "2"]
    with pytest.raises(AutotuningError, match="arg_mappings maps 'nope'"):
        with_mapped_args([], {"nope": "--n"}, cfg)


# ----------------------------------------------------------------------------- tuners and budget
def _grid(stages=(0, 1, 2, 3), sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)):
    return [Candidate(s, m, 1, 2 * m) for s in stages for m in sizes]


def _synthetic(c: Candidate) -> float:
    """A throughput curve with one peak: best at micro-batch 64 with stage 2."""
    return 1000.0 * math.exp(-((math.log2(c.micro_batch) - 6) ** 2) / 4.0) * (1.3 if c.stage == 2 else 1.0)


def test_ridge_fit_recovers_a_linear_law():
    rows = [[1.0, x, x * x] for x in (0.0, 1.0, 2.0, 3.0, 5.0)]
    w = ridge_fit(rows, [2.0 - 0.5 * r[1] + 0.25 * r[2] for r in rows], penalty=1e-9)
    assert w == pytest.approx([2.0, -0.5, 0.25], abs=1e-6)


def test_grid_and_random_orders():
    pool = _grid(stages=(0, 1), sizes=(1, 2, 4))
    grid = GridSearchTuner(pool, "throughput")
    assert [grid.next() for _ in pool] == pool
    a, b = RandomTuner(pool, "throughput", seed=3), RandomTuner(pool, "throughput", seed=3)
    order = [a.next() for _ in pool]
    assert sorted(order, key=pool.index) == pool and order == [b.next() for _ in pool]


def test_model_based_tuner_reaches_the_best_in_few_trials():
    pool = _grid()  # 44 candidates; the best is 29th in grid order (12 random picks find it with p = 12/44)
    best = max(pool, key=_synthetic)
    assert pool.index(best) == 28
    for seed in range(5):
        tuner = ModelBasedTuner(pool, "throughput", seed=seed)
        seen = []
        explore(tuner, Budget(12, 100, "throughput"), lambda c: seen.append(c) or _synthetic(c))
        assert best in seen, (seed, [(c.stage, c.micro_batch) for c in seen])


def test_budget_trials_and_early_stopping():
    pool = _grid(stages=(0,))
    seen = []
    budget = Budget(num_trials=4, early_stopping=100, metric="throughput")
    explore(GridSearchTuner(pool, "throughput"), budget, lambda c: seen.append(c) or float(c.micro_batch))
    assert len(seen) == 4 and "tuner_num_trials" in budget.stop_reason
    # latency: lower is better; values rise after the 2nd experiment -> stop 3 experiments later
    values = iter([5.0, 4.0, 4.5, 6.0, 7.0, 1.0, 1.0])
    budget = Budget(num_trials=50, early_stopping=3, metric="latency")
    seen = []
    explore(GridSearchTuner(pool, "latency"), budget, lambda c: seen.append(c) or next(values))
    assert len(seen) == 5 and "early stopping" in budget.stop_reason
    assert budget.best == -4.0


# ----------------------------------------------------------------------------- the observer in an engine
def _bias_free_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False))


@pytest.mark.parametrize("start,end,gas", [(1, 3, 2), (0, 1, 1)])
def test_observer_measures_the_profile_steps_and_ends_the_run(tmp_path, start, end, gas):
    path = tmp_path / "metrics.json"
    mbs = 4
    engine = tiny_engine({"train_batch_size": mbs * gas, "train_micro_batch_size_per_gpu": mbs,
                          "gradient_accumulation_steps": gas,
                          "autotuning": {"enabled": True, "metric_path": str(path), "start_profile_step": start,
                                         "end_profile_step": end}}, model=_bias_free_mlp())
    with pytest.raises(SystemExit) as stopped:
        train_steps(engine, 20)
    assert stopped.value.code == 0
    # steps are counted from 0: start..end measured; FLOPs counted on step 0 or, when start is 0, one step after
    assert engine.global_steps == (end + 1 if start >= 1 else end + 2)
    m = json.loads(path.read_text())
    assert m["measured_steps"] == end - start + 1
    assert m["train_batch_size"] == mbs * gas
    assert m["throughput"] == pytest.approx(mbs * gas / (m["latency"] / 1000.0), rel=1e-12)
    forward = 2 * mbs * (8 * 16 + 16 * 4) + mbs * 16  # two matmuls + tanh (one FLOP per element)
    assert m["forward_flops_per_micro_batch"] == forward
    assert m["flops"] == pytest.approx(3 * forward * gas / (m["latency"] / 1000.0), rel=1e-12)


def test_observer_model_info_run(tmp_path):
    path = tmp_path / "model_info.json"
    engine = tiny_engine({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
                          "autotuning": {"enabled": True, "model_info": {"profile": True},
                                         "model_info_path": str(path)}})
    with pytest.raises(SystemExit):
        train_steps(engine, 5)
    assert engine.global_steps == 1
    info = json.loads(path.read_text())
    assert info["num_params"] == sum(p.numel() for p in engine.module.parameters()) == 8 * 16 + 16 + 16 * 4 + 4
    # autograd keeps the input of Linear(8, 16) and the Tanh output (also Linear(16, 4)'s input): (8 + 16) fp32 values
    assert info["activation_mem_per_sample"] == (8 + 16) * 4
    assert info["activation_mem_per_gpu"] == 4 * (8 + 16) * 4


def test_an_autotuning_section_without_metric_path_changes_nothing(tmp_path):
    engine = tiny_engine({"train_batch_size": 2, "autotuning": {"enabled": True, "start_profile_step": 0,
                                                             "end_profile_step": 1}})
    assert not [o for o in engine.observers if type(o).__name__ == "AutotuningObserver"]
    train_steps(engine, 4)
    assert engine.global_steps == 4


# ----------------------------------------------------------------------------- a whole tuning, stand-in runner
class StandInRunner:
    """Runs no process: writes what the observer would (metrics from a formula, or model info)."""

    def __init__(self, throughput, model_info):
        self.throughput, self.model_info, self.launched = throughput, model_info, []

    def command(self, exp):
        return ["stand-in", exp.name]

    def reuse(self, exp):
        return False

    def run(self, exp):
        self.launched.append(exp.name)
        if exp.name == PROFILE_RUN:
            data = dict(self.model_info)
        else:
            tput = self.throughput(exp.candidate)
            data = {"throughput": tput, "latency": 1000.0 * exp.candidate.train_batch / tput, "flops": None}
        write_json_atomic(exp.output_file, data)
        exp.metrics, exp.status, exp.seconds = data, "done", 0.0


def _args(tmp_path, config, **flags):
    (tmp_path / "ds.json").write_text(json.dumps(config))
    values = dict(user_script="train.py", user_args=["--deepspeed_config", "ds.json"], num_gpus=None, num_procs=2,
                  autotuning="tune")
    values.update(flags)
    return argparse.Namespace(**values)


def parse_table(text):
    """``{experiment: row}`` of the ranked table ``dsplug launch --autotuning`` prints, in rank order."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("rank  experiment"))
    names = lines[head].split()
    rows = {}
    for line in lines[head + 1:]:
        if not re.match(r"\d+\s", line):
            break
        row = dict(zip(names, line.split()))
        rows[row["experiment"]] = row
    return rows


def check_results_match_table(results_dir, exps_dir, printed, metric):
    """The printed ranking equals the recorded metrics, and the optimal config is the best's."""
    rows = parse_table(printed)
    assert rows, printed
    summary = json.loads((results_dir / "summary.json").read_text())
    assert [r["name"] for r in summary["ranking"]] == list(rows)
    recorded = {}
    for name, row in rows.items():
        m = json.loads((results_dir / name / "metrics.json").read_text())
        recorded[name] = m[metric]
        for key, column in (("latency", "latency_ms"), ("throughput", "throughput")):
            assert float(row[column]) == pytest.approx(m[key], rel=1e-5)
        cfg = json.loads((exps_dir / name / "ds_config.json").read_text())
        assert (int(row["stage"]), int(row["micro_batch"]), int(row["grad_acc"]), int(row["train_batch"])) == (
            cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"],
            cfg["gradient_accumulation_steps"], cfg["train_batch_size"])
    higher = metric != "latency"
    assert list(rows) == sorted(recorded, key=lambda n: -recorded[n] if higher else recorded[n])
    best = list(rows)[0]
    optimal = json.loads((results_dir / "ds_config_optimal.json").read_text())
    expected = json.loads((exps_dir / best / "ds_config.json").read_text())
    expected.pop("autotuning")
    assert optimal == expected and summary["best"] == best
    return rows


def test_whole_tuning_prunes_tunes_knobs_and_writes_matching_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    psi = 10_000
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": [2, 8],
              "zero_optimization": {"stage": "all"},
              "autotuning": {"fast": False, "tuner_type": "gridsearch", "tuner_early_stopping": 50,
                             # fp32 AdamW, 2 ranks: stage 0 16 psi, 1: 12 psi, 2: 10 psi, 3: 8 psi (+ activations)
                             "device_memory": 11 * psi + 8 * 100}}
    runner = StandInRunner(lambda c: 100.0 * c.micro_batch + c.stage
                           + (50.0 if dict(c.knobs).get("overlap_comm") else 0.0),
                           {"num_params": psi, "activation_mem_per_sample": 100.0})
    out = io.StringIO()
    tuner = Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=out, runner=runner)
    best = tuner.tune()
    tuner.print_tuning_results()
    tuner.write_optimal_config()
    printed = out.getvalue()
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    by_stage = {}
    for e in tuner.experiments:
        by_stage.setdefault(e.candidate.stage, []).append(e)
    # memory: stage 0 (16 psi) and 1 (12 psi) do not fit 11 psi + 800 B; stage 2 (10 psi) + 8 x 100 B fits
    assert [e.status for s in (0, 1) for e in by_stage[s]] == ["pruned"] * 4
    assert all(e.status == "done" for s in (2, 3) for e in by_stage[s])
    pruned = json.loads((results / "z0_mbs2_gas1" / "result.json").read_text())
    assert pruned["status"] == "pruned" and "> budget" in pruned["reason"]
    assert pruned["memory_estimate"]["model_states"] == 16 * psi and pruned["memory_estimate"]["activations"] == 200
    assert json.loads((results / by_stage[1][0].name / "result.json").read_text())["memory_estimate"][
        "model_states"] == 12 * psi
    assert not any(n.startswith(("z0_", "z1_")) for n in runner.launched)
    assert not (results / "z0_mbs2_gas1" / "metrics.json").exists()
    assert runner.launched[0] == PROFILE_RUN
    # phase 1: 4 experiments at the default knobs; phase 2: the rest of the stage-3 knob grid at micro-batch 8
    assert len(runner.launched) == 1 + 4 + 7
    assert len({n for n in runner.launched if n.startswith("z3_mbs8_gas1_")}) == 8  # the whole 2 x 2 x 2 grid
    assert best.candidate.stage == 3 and best.candidate.micro_batch == 8 and dict(best.candidate.knobs)["overlap_comm"]
    rows = check_results_match_table(results, exps, printed, "throughput")
    assert list(rows)[0] == best.name
    assert (results / "cmd_optimal.txt").read_text().split() == [
        "dsplug", "launch", "--num_procs", "2", "train.py", "--deepspeed_config",
        os.path.join("autotuning_results", "ds_config_optimal.json")]
    # every experiment has its description and result on disk
    for e in tuner.experiments:
        assert (results / e.name / "result.json").exists() and (exps / e.name / "exp.json").exists()


def test_whole_tuning_stops_at_the_trial_budget(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"train_micro_batch_size_per_gpu": [1, 2, 4, 8], "zero_optimization": {"stage": 0},
              "autotuning": {"tuner_type": "gridsearch", "tuner_num_trials": 3, "model_info": {"num_params": 100}}}
    runner = StandInRunner(lambda c: float(c.micro_batch), {})
    tuner = Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=io.StringIO(), runner=runner)
    tuner.tune()
    assert runner.launched == ["z0_mbs1_gas1", "z0_mbs2_gas1", "z0_mbs4_gas1"]  # num_params given: no profile run
    assert "tuner_num_trials" in tuner.stop_reason
    left = json.loads((tmp_path / "autotuning_results" / "z0_mbs8_gas1" / "result.json").read_text())
    assert left["status"] == "not run"


def test_requests_that_cannot_be_carried_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = _args(tmp_path, {"autotuning": {"metric": "speed"}})
    assert run_autotuning(bad, {"localhost": [0, 1]}) == 2
    assert "autotuning.metric" in capsys.readouterr().err
    args = _args(tmp_path, {})
    args.user_args = ["--lr", "1"]
    assert run_autotuning(args, {"localhost": [0, 1]}) == 2
    assert "--deepspeed_config FILE" in capsys.readouterr().err
    assert run_autotuning(_args(tmp_path, {}, print_only=True), {"localhost": [0, 1]}) == 2
    assert "--print_only cannot be combined" in capsys.readouterr().err
    assert run_autotuning(_args(tmp_path, {"autotuning": {"mp_size": 4}}), {"localhost": [0, 1]}) == 2
    assert "mp_size 4" in capsys.readouterr().err


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("fixed,count,expected", [
    # 48 / 2 ranks = 24 per rank: geometric 1, 5, 24 -> 5 snaps to 6 (log-nearest divisor of 24)
    ({"train_batch_size": 48}, 3, [1, 6, 24]),
    # geometric 1, 2, 5, 11, 24 -> 5 to 6, 11 to 12
    ({"train_batch_size": 48}, 5, [1, 2, 6, 12, 24]),
    # gas fixed at 4: the only micro-batch size is 48 / (2 x 4) = 6
    ({"train_batch_size": 48, "gradient_accumulation_steps": 4}, 3, [6]),
])
def test_fixed_train_batch_tunes_sizes_that_divide_it(tmp_path, monkeypatch, fixed, count, expected):
    monkeypatch.chdir(tmp_path)
    config = {**fixed, "zero_optimization": {"stage": 0},
              "autotuning": {"tuner_type": "gridsearch", "num_tuning_micro_batch_sizes": count,
                             "model_info": {"num_params": 100}}}
    runner = StandInRunner(lambda c: float(c.micro_batch), {})
    tuner = Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=io.StringIO(), runner=runner)
    tuner.tune()
    done = [e.candidate for e in tuner.experiments if e.status == "done"]
    assert [c.micro_batch for c in done] == expected
    assert all(e.status == "done" for e in tuner.experiments)  # nothing skipped for its batch settings
    for c in done:  # every experiment keeps the user's batch: mbs x gas x 2 ranks = 48, mbs divides 24
        assert c.train_batch == 48 == c.micro_batch * c.gas * 2 and c.micro_batch in _divisors(24)
    assert tuner.best.candidate.micro_batch == expected[-1]


def test_fixed_train_batch_that_no_size_fits_is_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"train_batch_size": 47, "zero_optimization": {"stage": 0},  # odd: not divisible over 2 ranks
              "autotuning": {"model_info": {"num_params": 100}}}
    tuner = Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=io.StringIO(),
                      runner=StandInRunner(lambda c: 1.0, {}))
    assert tuner.tune() is None
    assert [e.status for e in tuner.experiments] == ["skipped"]
    assert "train_batch_size 47 is not a multiple" in tuner.experiments[0].reason


def test_model_info_run_uses_the_highest_valid_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 1-bit Adam runs at stage 0 only: the model-info run must not be at stage 3
    config = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": [2],
              "zero_optimization": {"stage": "all"}, "autotuning": {"tuner_type": "gridsearch"}}
    runner = StandInRunner(lambda c: 1.0, {"num_params": 100, "activation_mem_per_sample": 4.0})
    tuner = Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=io.StringIO(), runner=runner)
    best = tuner.tune()
    profile = json.loads((tmp_path / "autotuning_exps" / PROFILE_RUN / "ds_config.json").read_text())
    assert profile["zero_optimization"]["stage"] == 0
    assert best is not None and best.candidate.stage == 0
    status = {e.candidate.stage: e for e in tuner.experiments}
    for stage in (1, 2, 3):
        assert status[stage].status == "invalid" and "OneBitAdam" in status[stage].reason
    # with no valid stage at all the request fails, naming each stage's error
    config["zero_optimization"]["stage"] = [1, 3]
    with pytest.raises(AutotuningError) as err:
        Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=io.StringIO(), runner=runner).tune()
    text = str(err.value)
    assert "stage 3:" in text and "stage 1:" in text and "OneBitAdam" in text and "model-info" in text


def test_no_knob_phase_once_the_trial_budget_is_spent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # phase 1 uses exactly tuner_num_trials: the knob grid is neither built nor announced
    config = {"train_micro_batch_size_per_gpu": [1, 2], "zero_optimization": {"stage": 2},
              "autotuning": {"fast": False, "tuner_type": "gridsearch", "tuner_num_trials": 2,
                             "model_info": {"num_params": 100}}}
    out = io.StringIO()
    runner = StandInRunner(lambda c: float(c.micro_batch), {})
    tuner = Autotuner(_args(tmp_path, config), {"localhost": [0, 1]}, stream=out, runner=runner)
    tuner.tune()
    assert len(tuner.experiments) == 2 and len(runner.launched) == 2
    assert "knobs" not in out.getvalue() and "tuner_num_trials reached" in tuner.stop_reason


def test_a_timed_out_experiment_leaves_no_process_behind(tmp_path):
    from dsplug.plugins.autotuning.runner import Experiment, LaunchRunner

    pid_file = tmp_path / "child.pid"
    fake = tmp_path / "fake_python"  # a launcher with a worker that ignores SIGTERM, as a hung one may
    fake.write_text(f"#!/bin/sh\nsh -c 'trap \"\" TERM; sleep 60' &\necho $! > {pid_file}\nwait\n")
    fake.chmod(0o755)
    exp = Experiment("e", None, {}, str(tmp_path / "x"), str(tmp_path / "r"), str(tmp_path / "r" / "metrics.json"))
    runner = LaunchRunner(lambda: [], "train.py", lambda e: [], python=str(fake), timeout=1)
    runner.run(exp)
    child = int(pid_file.read_text())
    try:
        assert exp.status == "timeout"
        deadline = time.monotonic() + scaled(10)
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the experiment's worker outlived it"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid):
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


# ----------------------------------------------------------------------------- DeepSpeed names
def test_deepspeed_names_resolve():
    import dsplug.autotuning as at
    from dsplug.unavailable import attribute_error, module_error

    assert at.Autotuner is Autotuner and at.DeepSpeedAutotuningConfig is AutotuningConfig
    assert attribute_error("add_tuning_arguments") is None and module_error("deepspeed.autotuning") is None
    parser = dsplug.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_num_steps", "10", "--cycle_momentum"])
    assert (args.lr_schedule, args.warmup_num_steps, args.warmup_max_lr, args.warmup_type) == ("WarmupLR", 10,
                                                                                              0.001, "log")
    assert args.cycle_momentum and args.cycle_min_lr == 0.01 and args.lr_range_test_step_size == 1000


def test_launcher_accepts_the_flag():
    from dsplug.launcher.runner import parse_args

    args = parse_args(["--num_procs", "2", "--autotuning", "run", "train.py", "--deepspeed_config", "ds.json"])
    assert args.autotuning == "run" and args.user_args == ["--deepspeed_config", "ds.json"]
    with pytest.raises(SystemExit):
        parse_args(["--autotuning", "search", "train.py"])


class TestAutotuningObserverContract(ObserverContract):
    plugin_name = "autotuning"
    # measuring far beyond the contract's few steps: the observer is on the bus and ends nothing
    section = {"enabled": True, "metric_path": "{tmp_path}/metrics.json", "start_profile_step": 100,
               "end_profile_step": 100}


@pytest.mark.parametrize("body,status,reason", [
    ("echo boom >&2; exit 3", "failed", "exit status 3: boom"),
    ("exit 0", "failed", "ended without writing its measurement"),
    ("exec sleep 60", "timeout", "experiment_timeout 1 s"),
    ('echo \'{"throughput": 5.0}\' > "$OUT_FILE"', "done", ""),
])
def test_experiment_outcomes(tmp_path, body, status, reason):
    from dsplug.plugins.autotuning.runner import Experiment, LaunchRunner

    fake = tmp_path / "fake_python"  # stands in for `python -m dsplug.cli launch ...`
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    exp = Experiment("z0_mbs1_gas1", None, {"a": 1}, str(tmp_path / "exps" / "e"), str(tmp_path / "res" / "e"),
                     str(tmp_path / "res" / "e" / "metrics.json"))
    runner = LaunchRunner(lambda: [], "train.py", lambda e: [], python=str(fake), cwd=str(tmp_path), timeout=1,
                          environ={**os.environ, "OUT_FILE": exp.output_file})
    runner.run(exp)
    assert exp.status == status and reason in exp.reason, exp.reason
    assert exp.seconds < 40  # a timed-out experiment is stopped, not waited for
    assert (tmp_path / "res" / "e" / "stderr.log").exists() and (tmp_path / "res" / "e" / "cmd.txt").exists()


def test_a_taken_rendezvous_port_is_retried_once(tmp_path):
    from dsplug.plugins.autotuning.runner import Experiment, LaunchRunner

    fake = tmp_path / "fake_python"  # the first launch finds its port taken, the second succeeds
    fake.write_text('#!/bin/sh\nif [ -e "$MARK" ]; then echo \'{"throughput": 1.0}\' > "$OUT_FILE"; exit 0; fi\n'
                    'touch "$MARK"; echo "RuntimeError: The server socket has failed to listen on any local network '
                    'address. port: 29500 (errno: 98 - Address already in use)" >&2; exit 1\n')
    fake.chmod(0o755)
    exp = Experiment("e", None, {}, str(tmp_path / "x"), str(tmp_path / "r"), str(tmp_path / "r" / "metrics.json"))
    ports = iter(["1", "2"])
    runner = LaunchRunner(lambda: ["--master_port", next(ports)], "train.py", lambda e: [], python=str(fake),
                          environ={**os.environ, "OUT_FILE": exp.output_file, "MARK": str(tmp_path / "mark")})
    runner.run(exp)
    assert exp.status == "done" and exp.command[exp.command.index("--master_port") + 1] == "2"


# ----------------------------------------------------------------------------- the launcher asks
def test_launch_autotuning_is_answered_by_the_plugin_and_refused_without_it(monkeypatch, capsys):
    """``dsplug launch --autotuning`` reaches the autotuning plugin through dsplug_launch_override;
    without the plugin the launcher says what is missing instead of launching plain training."""
    import dsplug.registry as registry_module
    from dsplug.cli import main as cli_main

    # with the plugin: it answers (and refuses --print_only, which tuning cannot honour)
    assert cli_main(["launch", "--autotuning", "tune", "--print_only", "train.py"]) == 2
    assert "--print_only cannot be combined with --autotuning" in capsys.readouterr().err

    blocked = registry_module.Registry(blocked=("autotuning",))
    monkeypatch.setattr(registry_module, "get_registry", lambda: blocked)
    assert cli_main(["launch", "--autotuning", "run", "--print_only", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--autotuning run needs the autotuning plugin, which is not installed or is blocked" in err
    assert cli_main(["launch", "--num_procs", "1", "--print_only", "train.py"]) == 0  # plain launches go on


@pytest.mark.parametrize("resources, nodes, gpus", [
    ({"worker-0": [0, 1, 2, 3]}, 1, 4),
    ({"worker-0": [0], "worker-1": [0, 1, 2]}, 2, 1),
    ({"worker-0": [0, 1], "worker-2": [4, 5]}, 2, 2),
])
def test_deepspeeds_experiment_node_and_slot_counts(tmp_path, resources, nodes, gpus):
    tuner = Autotuner(_args(tmp_path, {"autotuning": {"enabled": True}}), resources, cwd=str(tmp_path))
    assert (tuner.exp_num_nodes, tuner.exp_num_gpus) == (nodes, gpus)
    assert tuner.world_size == sum(len(v) for v in resources.values())
