"""Data efficiency, curriculum side: the data analyzer (worker processes, index files), the
difficulty schedules (closed forms), the curriculum sampler (difficulty bound for value and
percentile, determinism, rank sharding, mid-epoch resume) and its wiring into the engine's
training loader (``dsplug_dataloader_options``), custom schedules through
``engine.set_custom_curriculum_learning_schedule``, and ``dsplug config check`` of DeepSpeed's
documented example section (tests/data/data_efficiency/reference_example.json; its curriculum
paths are placeholders, so that part is checked by config check only -- the random-LTD part also
trains, in tests/plugins/data_efficiency/test_random_ltd.py)."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dsplug.cli import main as cli_main
from dsplug.events import PluginHookError
from dsplug.hookspecs import hookimpl
from dsplug.plugins.data_efficiency.index_files import load_array, load_rows
from dsplug.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from dsplug.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from dsplug.testing import make_registry, tiny_engine
from tests.conftest import REPO

DATA = REPO / "tests" / "data" / "data_efficiency"
N = 240
LEVELS = 17


def difficulty_of(i: int) -> int:
    """The test metric of sample i: 1..17, unevenly spread over indices."""
    return (i * 7 + i // 5) % LEVELS + 1


class SeqDataset(torch.utils.data.Dataset):
    """Sample i: (a row of tokens whose length is the metric, padded to LEVELS; the index)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        row = torch.zeros(LEVELS, dtype=torch.long)
        row[:difficulty_of(i)] = 1 + i % 5
        return row, i


def nonzero_length(batch):  # single_value_per_sample
    return (batch[0] != 0).sum(dim=1)


def token_sum(batch):  # accumulate_value_over_samples
    return batch[0].sum(dim=0)


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    DataAnalyzer(SeqDataset(), num_threads=2, batch_size=16, metric_names=["seqlen", "tokens"],
                 metric_functions=[nonzero_length, token_sum],
                 metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
                 metric_dtypes=[np.int64, np.int64], save_path=str(root)).run_map_reduce()
    return root


# ---------------------------------------------------------------------------------------- analyzer
def test_analyzer_with_two_worker_processes_equals_a_direct_computation(analyzed):
    ds = SeqDataset()
    metric = np.array([int((ds[i][0] != 0).sum()) for i in range(N)])
    files = sorted(p.name for p in (analyzed / "seqlen").iterdir() if p.is_file())
    assert files == ["seqlen_index_to_metric.npy", "seqlen_index_to_sample.npz",
                     "seqlen_index_to_sample_percentile_merged.npz", "seqlen_sample_to_metric.npy"]
    assert sorted(p.name for p in (analyzed / "seqlen").iterdir() if p.is_dir()) == ["worker0_thread0",
                                                                                      "worker0_thread1"]
    np.testing.assert_array_equal(load_array(analyzed / "seqlen" / "seqlen_sample_to_metric"), metric)
    values = load_array(analyzed / "seqlen" / "seqlen_index_to_metric.npy")
    np.testing.assert_array_equal(values, sorted(set(metric)))
    rows = load_rows(analyzed / "seqlen" / "seqlen_index_to_sample")
    assert len(rows) == len(values)
    for v, row in zip(values, rows):
        np.testing.assert_array_equal(row, [i for i in range(N) if metric[i] == v])
    merged = load_rows(analyzed / "seqlen" / "seqlen_index_to_sample_percentile_merged.npz")
    np.testing.assert_array_equal(merged.data, sorted(range(N), key=lambda i: (metric[i], i)))
    total = sum(ds[i][0].sum() for i in range(N))
    assert load_array(analyzed / "tokens" / "tokens_metric_value.npy").sum() == int(total)
    np.testing.assert_array_equal(load_array(analyzed / "tokens" / "tokens_metric_value.npy"),
                                  torch.stack([ds[i][0] for i in range(N)]).sum(0).numpy())


def test_analyzer_separate_workers_then_one_reduce(tmp_path, analyzed):
    kwargs = dict(num_workers=2, batch_size=7, metric_names=["seqlen"], metric_functions=[nonzero_length],
                  metric_types=["single_value_per_sample"], metric_dtypes=[np.int64], save_path=str(tmp_path))
    first = DataAnalyzer(SeqDataset(), worker_id=0, **kwargs)
    first.run_map()
    with pytest.raises(FileNotFoundError, match="1 shard"):
        first.run_reduce()
    DataAnalyzer(SeqDataset(), worker_id=1, **kwargs).run_map()
    first.run_reduce()
    for name in ("seqlen_index_to_sample", "seqlen_index_to_sample_percentile_merged"):
        a, b = load_rows(tmp_path / "seqlen" / name), load_rows(analyzed / "seqlen" / name)
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(a.offsets, b.offsets)


def test_analyzer_reports_a_failing_worker_process(tmp_path):
    def broken(batch):
        raise ValueError("metric exploded")

    with pytest.raises(RuntimeError, match="metric exploded"):
        DataAnalyzer(SeqDataset(), num_threads=2, metric_names=["x"], metric_functions=[broken],
                     metric_types=["single_value_per_sample"], metric_dtypes=[np.int64],
                     save_path=str(tmp_path)).run_map()


# ---------------------------------------------------------------------------------------- schedules
def metric_config(kind: str, **over):
    base = {"min_difficulty": 2, "max_difficulty": 50, "schedule_type": kind,
            "schedule_config": {"total_curriculum_step": 40, "difficulty_step": 4, "root_degree": 3,
                                "difficulty": [3, 9, 27], "max_step": [5, 12]},
            "index_to_sample_path": "x", "index_to_metric_path": "y"}
    base.update(over)
    from dsplug.config.schema import parse
    from dsplug.plugins.data_efficiency.config import CurriculumMetricConfig

    return parse(CurriculumMetricConfig, base, "m")


def test_schedules_equal_their_closed_forms():
    from dsplug.plugins.data_efficiency.schedules import CurriculumSchedule, random_ltd_value

    for kind, degree in (("fixed_linear", 1), ("fixed_root", 3)):
        schedule = CurriculumSchedule(metric_config(kind))
        for step in range(0, 60):
            d = math.floor((min(step, 40) / 40) ** (1 / degree) * 48 + 2)
            assert schedule.get_difficulty(step) == min(d - d % 4, 50), (kind, step)
    discrete = CurriculumSchedule(metric_config("fixed_discrete"))
    assert [discrete.get_difficulty(s) for s in (0, 5, 6, 12, 13, 100)] == [3, 3, 9, 9, 27, 27]
    for step in range(0, 30):
        v = 16 + (100 - 16) * min(1.0, step / 20)
        assert random_ltd_value(step, 16, 100, 20, 8) == math.floor(v) - math.floor(v) % 8
    # once at max_difficulty the schedule is not recomputed (DeepSpeed's update_difficulty)
    custom = CurriculumSchedule(metric_config("custom"))
    custom.set_custom_get_difficulty(lambda s: 50 if s == 3 else 10)
    assert [custom.update_difficulty(s) for s in (1, 2, 3, 4)] == [10, 10, 50, 50]


# ---------------------------------------------------------------------------------------- sampler
def de_config(analyzed, difficulty_type="value", schedule="fixed_linear", seed=7, num_epochs=2, **metric):
    prefix = str(analyzed / "seqlen" / "seqlen")
    entry = {"index_to_sample_path": prefix + ("_index_to_sample" if difficulty_type == "value"
                                               else "_index_to_sample_percentile_merged"),
             "index_to_metric_path": prefix + "_index_to_metric", "difficulty_type": difficulty_type,
             "min_difficulty": 3 if difficulty_type == "value" else 10,
             "max_difficulty": LEVELS if difficulty_type == "value" else 100, "schedule_type": schedule,
             "schedule_config": {"total_curriculum_step": 12, "difficulty_step": 1}}
    entry.update(metric)
    return {"enabled": True, "seed": seed,
            "data_sampling": {"enabled": True, "num_epochs": num_epochs,
                              "curriculum_learning": {"enabled": True, "curriculum_metrics": {"seqlen": entry}}}}


def run(sampler, count=None):
    """[(micro-batch, difficulty when it was drawn)] for ``count`` micro-batches (all if None)."""
    out = []
    for batch in sampler:
        out.append((batch, sampler.current_difficulties["seqlen"]))
        if count is not None and len(out) == count:
            break
    return out


@pytest.mark.parametrize("difficulty_type", ["value", "percentile"])
def test_sampler_never_yields_a_sample_above_the_current_difficulty(analyzed, difficulty_type):
    sampler = DeepSpeedDataSampler(de_config(analyzed, difficulty_type), N, 4, 0, 1, None, 2, 0)
    order = sorted(range(N), key=lambda i: (difficulty_of(i), i))
    rank_in_order = {i: r for r, i in enumerate(order)}
    seen_difficulties, drawn = set(), run(sampler)
    assert len(drawn) == len(sampler) == 2 * N // 8 * 2
    for batch, d in drawn:
        seen_difficulties.add(d)
        for i in batch:
            if difficulty_type == "value":
                assert difficulty_of(i) <= d
            else:
                assert rank_in_order[i] < math.floor(N * d / 100)
    assert len(seen_difficulties) > 5  # the schedule moved through many difficulties
    assert {i for batch, _ in drawn for i in batch} == set(range(N))  # every sample once the difficulty allows


def test_sampler_is_deterministic_per_seed(analyzed):
    a = run(DeepSpeedDataSampler(de_config(analyzed, seed=3), N, 4, 0, 1, None, 1, 0), 30)
    b = run(DeepSpeedDataSampler(de_config(analyzed, seed=3), N, 4, 0, 1, None, 1, 0), 30)
    c = run(DeepSpeedDataSampler(de_config(analyzed, seed=4), N, 4, 0, 1, None, 1, 0), 30)
    assert a == b
    assert [x for x, _ in a] != [x for x, _ in c]


def test_ranks_share_each_global_batch_disjointly_and_completely(analyzed):
    micro, dp, gas = 3, 4, 2
    config = de_config(analyzed)
    per_rank = [run(DeepSpeedDataSampler(config, N, micro, r, dp, None, gas, r), 40) for r in range(dp)]
    reference = DeepSpeedDataSampler(config, N, micro, 0, dp, None, gas, 0)
    for k in range(40 // gas):
        reference.get_next_global_batch()
        expected = reference.batch
        got = [i for j in range(gas) for r in range(dp) for i in per_rank[r][k * gas + j][0]]
        assert got == expected  # in DeepSpeed's order: micro-step, then rank
        assert len(set(got)) == len(got) == micro * dp * gas


def test_sampler_resumes_mid_epoch_with_the_same_remaining_order(analyzed):
    config = de_config(analyzed, num_epochs=3)
    full = run(DeepSpeedDataSampler(config, N, 4, 1, 2, None, 3, 1))
    first = DeepSpeedDataSampler(config, N, 4, 1, 2, None, 3, 1)
    head = run(first, 47)  # mid global batch (3 micro-steps each) and past the first epoch's clusters
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    resumed = DeepSpeedDataSampler(config, N, 4, 1, 2, None, 3, 1)
    resumed.load_state_dict(state)
    assert head + run(resumed) == full


# ---------------------------------------------------------------------------------------- engine
class IndexDataset(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


ENGINE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "train_batch_size": 6}


def engine_for(analyzed, **de):
    config = dict(ENGINE, data_efficiency=de_config(analyzed, **de))
    return tiny_engine(config, training_data=IndexDataset())


def take(loader_iter, n):
    return [next(loader_iter).tolist() for _ in range(n)]


def test_engine_loader_uses_the_curriculum_sampler_and_resumes_from_a_checkpoint(analyzed, tmp_path):
    engine = engine_for(analyzed)
    sampler = engine.training_dataloader.batch_sampler
    assert type(sampler).__name__ == "DeepSpeedDataSampler" and engine.curriculum_learning_enabled()
    it = iter(engine.training_dataloader)
    head = take(it, 8)
    # global batches 1-3 (of 3 micro-batches): difficulty floor(3 / 12 * 14 + 3) = 6 at most
    assert all(difficulty_of(i) <= 6 for b in head for i in b)
    engine.save_checkpoint(tmp_path)
    tail = take(it, 20)
    resumed = engine_for(analyzed)
    resumed.load_checkpoint(tmp_path)
    assert take(iter(resumed.training_dataloader), 20) == tail
    # a loader built after the load (engine.deepspeed_io) starts where the checkpoint left off too
    late = tiny_engine(dict(ENGINE, data_efficiency=de_config(analyzed)))
    late.load_checkpoint(tmp_path)
    assert take(iter(late.deepspeed_io(IndexDataset())), 20) == tail


def test_custom_schedule_through_the_engine_method(analyzed):
    engine = engine_for(analyzed, schedule="custom")
    with pytest.raises(Exception, match="set_custom_curriculum_learning_schedule"):
        next(iter(engine.training_dataloader))
    schedule = {}

    def pace(step):
        schedule[step] = min(LEVELS, 2 + step // 2)
        return schedule[step]

    engine.set_custom_curriculum_learning_schedule({"seqlen": pace})
    sampler = engine.training_dataloader.batch_sampler
    it = iter(engine.training_dataloader)
    for _ in range(10):
        for _ in range(3):  # the micro-batches of one global batch
            batch = next(it).tolist()
            assert sampler.current_difficulties["seqlen"] == schedule[sampler.curriculum_step]
            assert all(difficulty_of(i) <= schedule[sampler.curriculum_step] for i in batch)
    assert sampler.curriculum_step == 10
    with pytest.raises(KeyError, match="not curriculum metrics"):
        engine.set_custom_curriculum_learning_schedule({"nope": pace})


def test_without_the_section_the_engine_keeps_its_default_loader():
    engine = tiny_engine(dict(ENGINE), training_data=IndexDataset())
    assert type(engine.training_dataloader.sampler).__name__ == "DistributedSampler"
    assert not engine.curriculum_learning_enabled() and not engine.random_ltd_enabled()
    assert not hasattr(engine, "set_custom_curriculum_learning_schedule")


# ---------------------------------------------------------------------------------------- config check
def check_cli(capsys, path) -> tuple:
    code = cli_main(["config", "check", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_documented_example_section_passes_config_check(tmp_path, capsys):
    config = json.loads((DATA / "reference_example.json").read_text())
    config["train_batch_size"] = 8
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    code, out, err = check_cli(capsys, path)
    assert code == 0, out + err
    assert "data_cluster_path" in out + err  # accepted, with a notice that it is not used

    bad = copy.deepcopy(config)
    ltd = bad["data_efficiency"]["data_routing"]["random_ltd"]
    ltd["random_ltd_layer_num"] = 21
    metric = bad["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocabularyrarity"]
    del metric["schedule_config"]["root_degree"]
    bad["data_efficiency"]["data_sampling"]["num_epoch"] = 1
    path.write_text(json.dumps(bad))
    code, out, err = check_cli(capsys, path)
    text = out + err
    assert code != 0
    assert "random_ltd.random_ltd_layer_num: is 21 but random_ltd_layer_id lists 22" in text
    assert "data_sampling.num_epoch: unknown key; did you mean 'data_efficiency.data_sampling.num_epochs'" in text
    assert "vocabularyrarity.schedule_config.root_degree: required by schedule_type 'fixed_root'" in text


@pytest.mark.filterwarnings("ignore::dsplug.config.dsconfig.DsplugConfigWarning")
def test_reference_example_curriculum_files_are_named_in_errors():
    """Its curriculum paths are placeholders: initialize names the missing file."""
    config = json.loads((DATA / "reference_example.json").read_text())
    config["data_efficiency"]["data_routing"]["enabled"] = False
    with pytest.raises(Exception, match="/path/to/index_to_sample"):
        tiny_engine(dict(ENGINE, **config), training_data=IndexDataset())


# ---------------------------------------------------------------------------------------- the hook contract
class Evens:
    def __init__(self, extra=None, name="tests.evens_sampler"):
        self.extra = extra or {}
        self.__name__ = name

    @hookimpl
    def dsplug_dataloader_options(self, engine, dataset, batch_size):
        return {"batch_sampler": [[i, i + 2][:batch_size] for i in range(0, len(dataset), 4)], **self.extra}


def test_dataloader_options_hook_sets_the_training_loaders_sampling():
    engine = tiny_engine(dict(ENGINE), registry=make_registry(Evens()), training_data=IndexDataset())
    assert [b.tolist() for b in engine.training_dataloader][:3] == [[0, 2], [4, 6], [8, 10]]
    # a caller's own data_sampler wins, and eval loaders are not the plugin's
    own = engine.deepspeed_io(IndexDataset(), data_sampler=torch.utils.data.SequentialSampler(range(N)))
    assert next(iter(own)).tolist() == [0, 1]
    assert next(iter(engine.deepspeed_io(IndexDataset(), route="eval"))).numel() == 2
    with pytest.raises(PluginHookError, match="both choose the training loader's sampling"):
        tiny_engine(dict(ENGINE), registry=make_registry(Evens(), Evens(name="tests.other")),
                    training_data=IndexDataset())
    with pytest.raises(PluginHookError, match="expected 'batch_sampler'"):
        tiny_engine(dict(ENGINE), registry=make_registry(Evens({"shuffle": True})), training_data=IndexDataset())
