"""`dsplug list` and `dsplug config explain` name the module implementing each plugin."""
from __future__ import annotations

import functools
import importlib
import json

from dsplug.cli import main
from dsplug.cli.cmd_list import plugin_module
from dsplug.descriptors import PluginSpec, Provided


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_json_has_the_module_of_every_plugin(capsys):
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0
    rows = {(p["category"], p["name"]): p for p in json.loads(out)["plugins"]}
    assert rows[("optimizer", "AdamW")]["module"] == "dsplug.plugins.optimizers.adam"
    assert rows[("monitor", "csv_monitor")]["module"] == "dsplug.plugins.monitors.csv_monitor"
    # torch optimizers by name are built by a functools.partial: the module is the plugin's, not functools
    assert rows[("optimizer", "RMSprop")]["module"] == "dsplug.plugins.optimizers.torch_optim"
    for row in rows.values():  # one hop: every module imports
        importlib.import_module(row["module"])


def test_list_table_has_a_module_column(capsys):
    code, out, _ = run(capsys, "list", "--category", "monitor")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["CATEGORY", "NAME", "DISTRIBUTION", "VERSION", "MODULE"]
    csv_row = next(line for line in lines if line.split()[:2] == ["monitor", "csv_monitor"])
    assert csv_row.split()[4] == "dsplug.plugins.monitors.csv_monitor"


def test_config_explain_names_the_module_of_each_plugin(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                "csv_monitor": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    code, out, _ = run(capsys, "config", "explain", str(path), "--json")
    assert code == 0
    served = json.loads(out)["served_by"]
    assert served["optimizer"] == "optimizer:AdamW (dsplug 0.1.0) dsplug.plugins.optimizers.adam"
    assert served["csv_monitor"].endswith(" dsplug.plugins.monitors.csv_monitor")
    assert served["zero_optimization.stage"].startswith("zero_stage:1 (dsplug")
    assert served["train_batch_size"] == "kernel"
    code, out, _ = run(capsys, "config", "explain", str(path))
    line = next(line for line in out.splitlines() if line.split()[:1] == ["csv_monitor"])
    assert line.split()[-1] == "dsplug.plugins.monitors.csv_monitor"


def _build(section, context):
    return None


def test_plugin_module_unwraps_partials_and_falls_back():
    spec = PluginSpec(category="observer", name="x", factory=functools.partial(functools.partial(_build), None))
    assert plugin_module(Provided(spec, "dist", "1", "ep")) == __name__
    bare = PluginSpec(category="section", name="y")
    assert plugin_module(Provided(bare, "dist", "1", "my_pkg.plugin")) == "my_pkg.plugin"
