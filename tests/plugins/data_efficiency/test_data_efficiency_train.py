"""DeepSpeed's ``data_efficiency`` reference example (curriculum data sampling over DataAnalyzer index
files + random-LTD with GPT's ``seq_batch_dim`` order) trains the built-in LM through
``dsplug train --config FILE``: index files built for the job's own dataset, the example's keys
kept (only the paths filled in), a 24-layer model so that layer ids 1..22 exist, and a context of
256 > the schedule's 128 kept tokens so that the random-LTD layers really drop tokens."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dsplug.cli import main as cli_main
from dsplug.plugins.train.data import CharVocab, CharWindows, split_tokens
from dsplug.plugins.train.model import CharTransformer
from dsplug.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from dsplug.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from tests.conftest import REPO

REFERENCE = REPO / "tests" / "data" / "data_efficiency" / "reference_example.json"
SEQ_LEN = 256
MODEL = ["--seq-len", str(SEQ_LEN), "--layers", "24", "--d-model", "8", "--heads", "2", "--sample-chars", "0"]


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def distinct_chars(batch):
    x, _y = batch
    return torch.tensor([len(torch.unique(row)) for row in x])


def write_text(path: Path) -> str:
    """~3 KB whose windows differ in how many distinct characters they hold."""
    rng = random.Random(0)
    parts = []
    for i in range(60):
        alphabet = "abcdefghijklmnopqrstuvwxyz"[:3 + (i * 7) % 23]
        parts.append("".join(rng.choice(alphabet + " ") for _ in range(50)))
    text = "\n".join(parts)
    path.write_text(text, encoding="utf-8")
    return text


def test_reference_example_trains_the_builtin_lm(tmp_path, capsys, monkeypatch, keep_threads):
    text = write_text(tmp_path / "text.txt")
    # the job's training dataset, as `dsplug train` builds it
    vocab = CharVocab.of_text(text)
    train_tokens, _held = split_tokens(torch.tensor(vocab.encode(text)), SEQ_LEN)
    dataset = CharWindows(train_tokens, SEQ_LEN)
    save = tmp_path / "analysis"
    DataAnalyzer(dataset, num_threads=1, batch_size=64, metric_names=["vocabularyrarity"],
                 metric_functions=[distinct_chars], metric_types=["single_value_per_sample"],
                 metric_dtypes=[np.int64], save_path=str(save)).run_map_reduce()
    metric_dir = save / "vocabularyrarity"
    sample_to_metric = np.load(metric_dir / "vocabularyrarity_sample_to_metric.npy")
    n = len(dataset)
    assert len(sample_to_metric) == n and n >= 200
    # percentile difficulty 1 (the schedule's value for the first steps): the floor(n / 100) samples of
    # lowest metric (ties by index)
    easiest = np.lexsort((np.arange(n), sample_to_metric))[:math.floor(n / 100)]
    limit = int(sample_to_metric[easiest].max())
    assert limit < int(sample_to_metric.max())  # so the filter is a real restriction

    config = json.loads(REFERENCE.read_text())
    curriculum = config["data_efficiency"]["data_sampling"]["curriculum_learning"]
    curriculum["data_cluster_path"] = str(tmp_path / "clusters")
    metric = curriculum["curriculum_metrics"]["vocabularyrarity"]
    metric["index_to_sample_path"] = str(metric_dir / "vocabularyrarity_index_to_sample_percentile_merged")
    metric["index_to_metric_path"] = str(metric_dir / "vocabularyrarity_index_to_metric")
    config.update({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
                   "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}})
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))

    seen_metrics, kept = [], []
    forward = CharTransformer.forward

    def recording(self, tokens, **kwargs):
        out = forward(self, tokens, **kwargs)
        if self.training:
            seen_metrics.extend(len(torch.unique(row)) for row in tokens)
            layers = [m for m in self.modules() if isinstance(m, RandomLayerTokenDrop)]
            kept.append([m.reserved_length if m.random_ltd_initialized else None for m in layers])
        return out

    monkeypatch.setattr(CharTransformer, "forward", recording)
    code = cli_main(["train", "--config", str(path), "--steps", "3", "--text", str(tmp_path / "text.txt"),
                     "--output-dir", str(tmp_path / "out"), *MODEL])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "done: 3 steps" in out.out and "nan" not in out.out.lower() and "inf" not in out.out.lower()
    # curriculum sampling: every training sample is among the easiest percentile
    assert len(seen_metrics) == 3 * 2 and max(seen_metrics) <= limit
    # random-LTD: 24 wrapped blocks; ids 1..22 keep min_value = 128 of the 256 tokens, 0 and 23 are plain
    assert len(kept) == 3
    for per_layer in kept:
        assert len(per_layer) == 24
        assert per_layer[0] is None and per_layer[23] is None
        assert per_layer[1:23] == [128] * 22
