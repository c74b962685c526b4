"""Monitor plugins: each is driven through the lifecycle hooks like an engine would, then what
it wrote is read back with an independent reader (TensorBoard's own event reader, the csv
module, wandb's transaction log, Comet's offline archive) and compared with the metrics fed in.
"""
from __future__ import annotations

import csv
import glob
import json
import struct
import sys
import time
import zipfile
from types import SimpleNamespace

import pluggy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsplug.config.schema import ConfigError, parse, to_dict
from dsplug.context import BuildContext
from dsplug.hookspecs import PROJECT, LifecycleSpecs
from dsplug.registry import get_registry
from tests.conftest import scaled

# DeepSpeed's tag for each step metric (written out here, not imported: this is the reference).
TAGS = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
    "forward_ms": "Train/Samples/elapsed_time_ms_forward",
    "backward_ms": "Train/Samples/elapsed_time_ms_backward",
    "step_ms": "Train/Samples/elapsed_time_ms_step",
}

# Five optimizer steps of 8 samples; loss_scale and the wall-clock times only on some steps.
STEPS = [
    {"loss": 2.5, "lr": 0.001, "loss_scale": 65536.0, "global_samples": 8, "global_steps": 1, "skipped": 0.0},
    {"loss": 1.75, "lr": 0.002, "loss_scale": 32768.0, "global_samples": 16, "global_steps": 2, "skipped": 1.0},
    {"loss": 1.125, "lr": 0.003, "global_samples": 24, "global_steps": 3, "skipped": 0.0,
     "forward_ms": 3.25, "backward_ms": 6.5, "step_ms": 1.5},
    {"loss": 0.8, "lr": 0.004, "global_samples": 32, "global_steps": 4, "skipped": 0.0,
     "forward_ms": 3.0, "backward_ms": 6.0, "step_ms": 1.25},
    {"loss": 0.625, "lr": 0.005, "global_samples": 40, "global_steps": 5, "skipped": 0.0},
]


def expected_series(steps=STEPS):
    """tag -> [(samples, value)] as DeepSpeed's monitor would write them."""
    out = {}
    for m in steps:
        for key, tag in TAGS.items():
            if key in m:
                out.setdefault(tag, []).append((m["global_samples"], m[key]))
    return out


DEFAULTS = {
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
    "comet": {"enabled": False, "samples_log_interval": 100, "project": None, "workspace": None,
              "api_key": None, "experiment_name": None, "experiment_key": None, "online": None, "mode": None},
}
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "comet": ("comet_ml", "comet")}


def spec_of(name):
    return get_registry().get("monitor", name).spec


def build(name, section, rank=0):
    spec = spec_of(name)
    return spec.factory(parse(spec.schema, section, name), BuildContext(rank=rank, world_size=max(2, rank + 1)))


def drive(observer, steps=STEPS):
    """Feed ``steps`` through a lifecycle plugin manager, as the engine does, then close."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(LifecycleSpecs)
    pm.register(observer)
    engine = SimpleNamespace(global_steps=0, global_samples=0)
    for metrics in steps:
        engine.global_steps, engine.global_samples = metrics["global_steps"], metrics["global_samples"]
        pm.hook.dsplug_step_end(engine=engine, metrics=dict(metrics))
    pm.hook.dsplug_engine_closed(engine=engine)


# ------------------------------------------------------------------------------ registration
@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_registered_with_deepspeed_defaults(name):
    spec = spec_of(name)
    assert (spec.category, spec.name, spec.section) == ("monitor", name, name)
    assert to_dict(parse(spec.schema, {}, name)) == DEFAULTS[name]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_disabled_builds_nothing(name, tmp_path):
    section = {"enabled": False}
    if name in ("tensorboard", "csv_monitor"):
        section["output_path"] = str(tmp_path)
    assert build(name, section) is None
    assert list(tmp_path.iterdir()) == []


def test_schema_errors_name_key_and_valid_values():
    with pytest.raises(ConfigError) as info:
        parse(spec_of("tensorboard").schema, {"enabled": "yes", "ouput_path": "/x"}, "tensorboard")
    text = str(info.value)
    assert "tensorboard.enabled: 'yes' is not valid: expected a boolean" in text
    assert "tensorboard.ouput_path: unknown key; did you mean 'tensorboard.output_path'?" in text

    with pytest.raises(ConfigError) as info:
        parse(spec_of("comet").schema,
              {"mode": "create_or_get", "experiment_key": "short", "samples_log_interval": -1}, "comet")
    text = str(info.value)
    assert "comet.mode: 'create_or_get' is not valid" in text and "'get_or_create', 'create', 'get'" in text
    assert "comet.experiment_key" in text and "32 to 50 letters or digits" in text
    assert "comet.samples_log_interval: -1 is not valid: must be >= 0" in text

    with pytest.raises(ConfigError, match=r"wandb.team: 3 is not valid: expected a string or null"):
        parse(spec_of("wandb").schema, {"team": 3}, "wandb")
    with pytest.raises(ConfigError, match=r"csv_monitor.job_name: None is not valid: expected a string"):
        parse(spec_of("csv_monitor").schema, {"job_name": None}, "csv_monitor")


def test_comet_accepts_a_valid_experiment_key():
    key = "0c4a1c4a90664f2a8084e600b19a9d7f"
    assert parse(spec_of("comet").schema, {"experiment_key": key, "mode": "get"}).experiment_key == key


# ------------------------------------------------------------------------------ missing extras
@pytest.mark.parametrize("name", sorted(EXTRAS))
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_extra_names_the_pip_extra(name, rank, monkeypatch, tmp_path):
    module, extra = EXTRAS[name]
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    section = {"enabled": True}
    if name == "tensorboard":
        section["output_path"] = str(tmp_path)
    from dsplug.plugins.monitors.events import MissingExtraError

    with pytest.raises(MissingExtraError) as info:
        build(name, section, rank=rank)
    text = str(info.value)
    assert f"pip install dsplug[{extra}]" in text
    assert f"{name}.enabled=true" in text and repr(module) in text
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ tensorboard
def _read_tensorboard(log_dir):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("one_event_per_step", [True, False])
def test_tensorboard_writes_deepspeed_tags_readable_by_tensorboard(tmp_path, one_event_per_step):
    observer = build("tensorboard", {"enabled": True, "output_path": str(tmp_path), "job_name": "run1"})
    assert observer.log_dir == str(tmp_path / "run1")
    if not one_event_per_step:
        observer._file_writer = None  # the add_scalar path (SummaryWriter without file_writer)
    drive(observer)
    assert glob.glob(str(tmp_path / "run1" / "events.out.tfevents.*"))
    written = _read_tensorboard(tmp_path / "run1")
    want = expected_series()
    assert sorted(written) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in written[tag]] == [s for s, _ in points]
        assert [v for _, v in written[tag]] == pytest.approx([v for _, v in points], rel=1e-6)  # float32


def test_tensorboard_empty_output_path_means_launch_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    observer = build("tensorboard", {"enabled": True})
    assert observer.log_dir == str(tmp_path / "DeepSpeedJobName")
    drive(observer, STEPS[:1])
    assert _read_tensorboard(tmp_path / "DeepSpeedJobName")["Train/Samples/lr"] == [(8, pytest.approx(0.001))]


# ------------------------------------------------------------------------------ csv
def _read_csv_dir(log_dir):
    out = {}
    for path in sorted(log_dir.glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        out[path.name] = rows
    return out


def test_csv_one_file_per_tag_with_header_and_exact_values(tmp_path):
    observer = build("csv_monitor", {"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    drive(observer)
    files = _read_csv_dir(tmp_path / "job")
    want = expected_series()
    assert sorted(files) == sorted(tag.replace("/", "_") + ".csv" for tag in want)
    for tag, points in want.items():
        rows = files[tag.replace("/", "_") + ".csv"]
        assert rows[0] == ["step", tag.rsplit("/", 1)[1]]
        assert [(int(s), float(v)) for s, v in rows[1:]] == points  # repr round-trips floats exactly


def test_csv_rows_reach_a_reader_while_training(tmp_path):
    from dsplug.plugins.monitors.csv_monitor import CsvMonitor

    observer = CsvMonitor(str(tmp_path), flush_interval_s=0.0)
    observer.dsplug_step_end(metrics=STEPS[0])
    observer.dsplug_step_end(metrics=STEPS[1])
    want = [["step", "train_loss"], ["8", "2.5"], ["16", "1.75"]]
    deadline = time.monotonic() + scaled(10)  # the writer thread gets there without a flush or close
    while _read_csv_dir(tmp_path).get("Train_Samples_train_loss.csv") != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _read_csv_dir(tmp_path)["Train_Samples_train_loss.csv"] == want
    observer.close()


def test_step_end_only_queues_and_writer_errors_surface(tmp_path):
    """A slow client library does not block the training step; its failures are not lost."""
    import threading

    from dsplug.plugins.monitors.csv_monitor import CsvMonitor

    gate = threading.Event()
    observer = CsvMonitor(str(tmp_path))
    real_write = observer._write

    def slow_write(events):
        gate.wait(scaled(10))
        real_write(events)

    observer._write = slow_write
    observer.dsplug_step_end(metrics=STEPS[0])
    # step_end returned while the writer is still blocked: nothing is written yet
    assert ["8", "2.5"] not in _read_csv_dir(tmp_path).get("Train_Samples_train_loss.csv", [])
    gate.set()
    observer.flush()
    assert _read_csv_dir(tmp_path)["Train_Samples_train_loss.csv"][1] == ["8", "2.5"]

    def failing_write(events):
        raise OSError("disk full")

    observer._write = failing_write
    observer.dsplug_step_end(metrics=STEPS[1])
    with pytest.raises(RuntimeError, match="csv_monitor monitor failed to write: OSError: disk full"):
        observer.flush()
    observer.close()


def test_csv_resumed_job_appends_without_second_header(tmp_path):
    section = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    drive(build("csv_monitor", section), STEPS[:2])
    drive(build("csv_monitor", section), STEPS[2:])
    rows = _read_csv_dir(tmp_path / "job")["Train_Samples_lr.csv"]
    assert rows[0] == ["step", "lr"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == expected_series()["Train/Samples/lr"]


def test_client_events_api_and_closed_monitor(tmp_path):
    """DeepSpeed scripts call ``monitor.write_events([(tag, value, step)])`` with their own tags."""
    import torch

    observer = build("csv_monitor", {"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    observer.write_events([("Eval/accuracy top1", torch.tensor(0.75), 100), ("Eval/accuracy top1", 0.8, 200)])
    observer.close()
    observer.close()  # idempotent
    assert _read_csv_dir(tmp_path / "j")["Eval_accuracy_top1.csv"] == [
        ["step", "accuracy top1"], ["100", "0.75"], ["200", "0.8"]]
    with pytest.raises(RuntimeError, match="csv_monitor monitor is closed"):
        observer.write_events([("x", 1.0, 1)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["a/b", "a/c d", "plain"]),
                          st.floats(allow_nan=False, width=64), st.integers(0, 2**40)), max_size=20))
def test_csv_round_trips_any_event_sequence(tmp_path_factory, events):
    from dsplug.plugins.monitors.csv_monitor import CsvMonitor

    log_dir = tmp_path_factory.mktemp("csv")
    observer = CsvMonitor(str(log_dir))
    observer.write_events(events)
    observer.close()
    files = _read_csv_dir(log_dir)
    for tag in {t for t, _, _ in events}:
        rows = files[tag.replace("/", "_").replace(" ", "_") + ".csv"]
        assert [(int(s), float(v)) for s, v in rows[1:]] == [(s, v) for t, v, s in events if t == tag]
    assert len(files) == len({t for t, _, _ in events})


# ------------------------------------------------------------------------------ rank != 0
@pytest.mark.parametrize("name", ["tensorboard", "csv_monitor", "wandb", "comet"])
def test_only_rank_zero_writes(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    section = {"enabled": True}
    if name in ("tensorboard", "csv_monitor"):
        section["output_path"] = str(tmp_path)
    if name == "comet":
        section["online"] = False
    assert build(name, section, rank=1) is None
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ step metrics
def test_events_from_metrics_keeps_present_values_only():
    import torch

    from dsplug.plugins.monitors.events import events_from_metrics

    got = events_from_metrics({"loss": torch.tensor(1.5), "lr": 0.1, "loss_scale": None,
                               "global_samples": 64, "global_steps": 4, "skipped": 0.0})
    assert got == [("Train/Samples/train_loss", 1.5, 64), ("Train/Samples/lr", 0.1, 64)]
    with pytest.raises(KeyError, match="global_samples"):
        events_from_metrics({"loss": 1.0, "lr": 0.1})


# ------------------------------------------------------------------------------ wandb (offline)
def _wandb_records(run_file):
    """The protobuf Records of a wandb transaction log (LevelDB log format)."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, parts, records = 32768, 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def _read_wandb_history(run_file, wait_s=60.0):
    """History rows of a finished run. wandb's service process may still be writing the log
    when ``run.finish()`` returns, so wait (bounded) for the run's exit record."""
    deadline = time.monotonic() + scaled(wait_s)
    while True:
        records = _wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            rows.append({k: v for k, v in items.items() if not k.startswith("_")} | {"_step": items["_step"]})
    return rows


def test_wandb_offline_run_holds_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.chdir(tmp_path)  # wandb reads its settings once per process: keep strays in tmp
    observer = build("wandb", {"enabled": True, "project": "dsplug-test", "group": "g1"})
    assert (observer.run.project, observer.run.group) == ("dsplug-test", "g1")
    run_file = observer.run.settings.sync_file
    drive(observer)
    rows = _read_wandb_history(run_file)
    want = {}
    for tag, points in expected_series().items():
        for samples, value in points:
            want.setdefault(samples, {})[tag] = value
    assert [row["_step"] for row in rows] == sorted(want)
    for row in rows:
        values = {k: v for k, v in row.items() if k != "_step"}
        assert values == pytest.approx(want[row["_step"]])


# ------------------------------------------------------------------------------ comet (offline)
COMET_QUIET = {
    "COMET_DISABLE_AUTO_LOGGING": "1", "COMET_AUTO_LOG_ENV_DETAILS": "false", "COMET_AUTO_LOG_GIT_METADATA": "false",
    "COMET_AUTO_LOG_GIT_PATCH": "false", "COMET_AUTO_LOG_CODE": "false", "COMET_AUTO_LOG_ENV_HOST": "false",
    "COMET_AUTO_LOG_ENV_CPU": "false", "COMET_AUTO_LOG_ENV_GPU": "false", "COMET_AUTO_LOG_ENV_NETWORK": "false",
    "COMET_AUTO_LOG_ENV_DISK": "false", "COMET_AUTO_LOG_CO2": "false",
}


def test_comet_offline_archive_holds_metrics_at_the_samples_interval(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    for key, value in COMET_QUIET.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    observer = build("comet", {"enabled": True, "online": False, "project": "dsplug-test",
                               "experiment_name": "monitors", "samples_log_interval": 16})
    drive(observer)
    [archive] = glob.glob(str(tmp_path / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
        experiment = json.loads(z.read("experiment.json"))
    assert experiment["project_name"] == "dsplug-test"
    assert {"key": "Name", "value": "monitors"}.items() <= next(
        m["payload"] for m in messages if m["type"] == "log_other" and m["payload"]["key"] == "Name").items()
    got = {}
    for m in messages:
        if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"].startswith("Train/"):
            metric = m["payload"]["metric"]
            got.setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
    # reference: a tag is sent when first seen, then once >= 16 samples passed since it was last sent
    want = {}
    for tag, points in expected_series().items():
        last = None
        for samples, value in points:
            if last is None or samples - last >= 16:
                want.setdefault(tag, []).append((samples, value))
                last = samples
    assert got == want
    assert want["Train/Samples/train_loss"] == [(8, 2.5), (24, 1.125), (40, 0.625)]
