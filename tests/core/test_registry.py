"""Plugin discovery through entry points, conflicts, blocking and did-you-mean."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from dsplug.config import ConfigError, DsplugConfig
from dsplug.registry import BLOCK_ENV, PluginConflictError, PluginNotFoundError, Registry

from tests.conftest import scaled, write_distribution

FROB = '''
from dsplug import PluginSpec, hookimpl
from dsplug.config.schema import field, schema

@schema
class FrobParams:
    lr: float = field(0.1, gt=0)

def build(params, config, context=None):
    import torch
    return torch.optim.SGD(params, lr=config.lr)

@hookimpl
def dsplug_optimizers():
    return [PluginSpec(category="optimizer", name="Frobnicate", factory=build, schema=FrobParams,
                       summary="test optimizer")]
'''


def test_builtins_register_through_entry_points(clean_env):
    registry = Registry()
    cpu = registry.get("accelerator", "cpu")
    assert cpu.distribution == "dsplug"
    assert cpu.entry_point == "accelerators"
    assert registry.find("section", "zero_optimization").distribution == "dsplug"


def test_throwaway_distribution_is_listed_and_selectable(temp_site, clean_env):
    write_distribution(temp_site, "frob-dist", "2.5", {"frob": "frob_plugin"}, {"frob_plugin": FROB})
    registry = Registry()
    found = registry.get("optimizer", "frobnicate")  # case-insensitive like optimizer.type
    assert (found.name, found.distribution, found.version) == ("Frobnicate", "frob-dist", "2.5")
    config = DsplugConfig({"train_batch_size": 4, "optimizer": {"type": "Frobnicate", "params": {"lr": 0.5}}},
                          world_size=1, registry=registry)
    assert config.optimizer.params.lr == 0.5
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr: -1 is not valid: must be > 0"):
        DsplugConfig({"train_batch_size": 4, "optimizer": {"type": "Frobnicate", "params": {"lr": -1}}},
                     world_size=1, registry=registry)


def test_dsplug_list_reports_third_party_distribution(temp_site, clean_env):
    write_distribution(temp_site, "frob-dist", "2.5", {"frob": "frob_plugin"}, {"frob_plugin": FROB})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(temp_site), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "dsplug.cli", "list", "--json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = {(p["category"], p["name"]): p for p in json.loads(out)["plugins"]}
    assert rows[("optimizer", "Frobnicate")]["distribution"] == "frob-dist"
    assert rows[("optimizer", "Frobnicate")]["version"] == "2.5"
    assert rows[("accelerator", "cpu")]["distribution"] == "dsplug"


def test_conflicting_names_error_names_both_distributions(temp_site, clean_env):
    write_distribution(temp_site, "frob-one", "1.0", {"frob1": "frob_one"}, {"frob_one": FROB})
    write_distribution(temp_site, "frob-two", "1.0", {"frob2": "frob_two"}, {"frob_two": FROB})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        registry = Registry()  # the conflict is reported, and the rest keeps working
    assert [b[1] for b in registry.broken] in (["frob-one"], ["frob-two"])
    assert registry.get("accelerator", "cpu")
    with pytest.raises(PluginConflictError) as err:
        registry.get("optimizer", "frobnicate")  # but the contested name cannot be selected
    message = str(err.value)
    assert "'Frobnicate'" in message and "'frob-one'" in message and "'frob-two'" in message
    assert BLOCK_ENV in message


def test_block_env_var_hides_a_plugin(temp_site, monkeypatch):
    write_distribution(temp_site, "frob-one", "1.0", {"frob1": "frob_one"}, {"frob_one": FROB})
    write_distribution(temp_site, "frob-two", "1.0", {"frob2": "frob_two"}, {"frob_two": FROB})
    monkeypatch.setenv(BLOCK_ENV, "frob2")  # resolves the conflict by entry-point name
    registry = Registry()
    assert registry.get("optimizer", "Frobnicate").distribution == "frob-one"
    monkeypatch.setenv(BLOCK_ENV, "frob-two, optimizer:Frobnicate")
    registry = Registry()
    assert registry.find("optimizer", "Frobnicate") is None
    with pytest.raises(PluginNotFoundError, match=f"blocked by {BLOCK_ENV}"):
        registry.get("optimizer", "Frobnicate")


def test_miss_gives_did_you_mean_and_installed_names(clean_env):
    registry = Registry()
    with pytest.raises(PluginNotFoundError) as err:
        registry.get("accelerator", "cdua", what="DSPLUG_ACCELERATOR")
    message = str(err.value)
    assert "Did you mean 'cuda'?" in message
    assert "Installed accelerator plugins: cpu, cuda." in message


def test_broken_plugin_is_reported_not_fatal(temp_site, clean_env):
    write_distribution(temp_site, "broken-dist", "0.1", {"broken": "broken_plugin"},
                       {"broken_plugin": "raise ImportError('missing dependency xyz')\n"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = Registry()
    assert any("broken-dist" in str(w.message) and "xyz" in str(w.message) for w in caught)
    assert registry.broken[0][:2] == ("broken", "broken-dist")
    assert registry.get("accelerator", "cpu")  # the rest still works


def test_spec_in_wrong_hook_is_reported_and_skipped(temp_site, clean_env):
    source = FROB.replace("def dsplug_optimizers", "def dsplug_schedulers")
    write_distribution(temp_site, "confused", "1.0", {"confused": "confused_plugin"}, {"confused_plugin": source})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        registry = Registry()
    assert "returned a 'optimizer' spec named 'Frobnicate' from dsplug_schedulers" in registry.broken[0][2]
    assert registry.find("scheduler", "Frobnicate") is None and registry.get("scheduler", "WarmupLR")


@pytest.mark.parametrize("fault, expected", [
    ("wrong_type", "returned 'Frobnicate' from dsplug_optimizers; expected dsplug.PluginSpec"),
    ("sys_exit", "SystemExit: 3"),
    ("misspelled", "dsplug_optimisers matches no dsplug hook, so it is never called; did you mean dsplug_optimizers?"),
    ("unmarked", "dsplug_monitors is not decorated with @dsplug.hookimpl"),
    ("bad_signature", "dsplug_step_end"),
    ("keyboard_interrupt", "KeyboardInterrupt: raised by the plugin itself"),
    ("generator_exit", "GeneratorExit"),
    ("base_exception", "Odd: a BaseException subclass"),
    ("interrupt_in_hook", "KeyboardInterrupt: from a hook"),
])
def test_a_faulty_plugin_is_reported_and_the_rest_keeps_working(temp_site, clean_env, fault, expected):
    source = {
        "wrong_type": FROB.replace("    return [PluginSpec(", "    return ['Frobnicate', PluginSpec("),
        "sys_exit": "import sys\nsys.exit(3)\n",
        "misspelled": FROB.replace("def dsplug_optimizers", "def dsplug_optimisers"),
        "unmarked": FROB + "\ndef dsplug_monitors():\n    return []\n",
        "bad_signature": FROB + "\n@hookimpl\ndef dsplug_step_end(engine, metrics, surprise):\n    pass\n",
        "keyboard_interrupt": "raise KeyboardInterrupt('raised by the plugin itself')\n",
        "generator_exit": "raise GeneratorExit()\n",
        "base_exception": "class Odd(BaseException):\n    pass\nraise Odd('a BaseException subclass')\n",
        "interrupt_in_hook": FROB.replace("    return [PluginSpec(", "    raise KeyboardInterrupt('from a hook')\n"
                                                                   "    return [PluginSpec("),
    }[fault]
    write_distribution(temp_site, "faulty-dist", "0.1", {"faulty": "faulty_plugin"}, {"faulty_plugin": source})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        registry = Registry()
    problems = [text for ep, dist, text in registry.broken if dist == "faulty-dist"]
    assert any(expected in text for text in problems), problems
    assert registry.get("optimizer", "adamw") and registry.get("accelerator", "cpu")
    import torch

    from dsplug.engine import Engine

    model = torch.nn.Linear(3, 1)  # training with the other plugins still works beside the faulty one
    engine = Engine(model, {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
                    registry=registry)
    before = model.weight.detach().clone()
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    assert engine.global_steps == 1 and not torch.equal(before, model.weight.detach())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(temp_site), os.environ.get("PYTHONPATH", "")]))
    listed = subprocess.run([sys.executable, "-m", "dsplug.cli", "list"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0 and "faulty-dist" in listed.stdout, listed.stderr


def test_plugin_whose_hook_raises_is_reported_not_fatal(temp_site, clean_env):
    source = FROB.replace("    return [PluginSpec(", "    raise RuntimeError('cannot describe myself')\n    return [PluginSpec(")
    write_distribution(temp_site, "raising-dist", "0.2", {"raising": "raising_plugin"}, {"raising_plugin": source})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        registry = Registry()
    assert registry.broken == [("raising", "raising-dist", "RuntimeError: cannot describe myself")]
    assert registry.find("optimizer", "Frobnicate") is None and registry.get("accelerator", "cpu")


PLUGIN_INTERRUPTS = "raise KeyboardInterrupt('raised by the plugin itself')\n"
INITIALIZE = ("import torch, dsplug\n"
              "engine = dsplug.initialize(model=torch.nn.Linear(3, 1), config={'train_batch_size': 2, 'optimizer': "
              "{'type': 'AdamW', 'params': {'lr': 0.1}}})[0]\n"
              "engine.backward(engine(torch.ones(2, 3)).sum()); engine.step(); print('trained', engine.global_steps)\n")


def test_initialize_survives_a_plugin_raising_keyboard_interrupt_at_import(temp_site, clean_env):
    write_distribution(temp_site, "kbd-dist", "0.1", {"kbd": "kbd_plugin"}, {"kbd_plugin": PLUGIN_INTERRUPTS})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(temp_site), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", INITIALIZE], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "trained 1" in done.stdout, done.stderr
    assert "kbd-dist" in done.stderr and "KeyboardInterrupt" in done.stderr  # reported as a broken plugin


def test_the_users_ctrl_c_during_plugin_import_is_not_contained(temp_site, clean_env):
    """A real SIGINT (here sent while a plugin imports) stops `dsplug list` like any Ctrl-C."""
    slow = "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n"
    write_distribution(temp_site, "slow-dist", "0.1", {"slow": "slow_plugin"}, {"slow_plugin": slow})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(temp_site), os.environ.get("PYTHONPATH", "")]))
    listed = subprocess.run([sys.executable, "-m", "dsplug.cli", "list"], env=env, capture_output=True, text=True,
                            timeout=scaled(120))
    assert listed.returncode == 130, (listed.returncode, listed.stderr)
    done = subprocess.run([sys.executable, "-c", INITIALIZE], env=env, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr and "trained" not in done.stdout


NO_CONFIG = '''
import torch
from dsplug import PluginSpec, hookimpl

def build(params, config, context=None):
    assert config == {}
    return torch.optim.SGD(params, lr=0.5)

@hookimpl
def dsplug_optimizers():
    return [PluginSpec(category="optimizer", name="Plain", factory=build, schema=None, summary="takes no config")]
'''


def test_an_optimizer_with_schema_none_takes_no_config_and_can_be_selected(temp_site, clean_env):
    import torch

    from dsplug.engine import Engine

    write_distribution(temp_site, "plain-dist", "1.0", {"plain": "plain_plugin"}, {"plain_plugin": NO_CONFIG})
    registry = Registry()
    for optimizer in ({"type": "Plain"}, {"type": "Plain", "params": {}}):
        config = DsplugConfig({"train_batch_size": 2, "optimizer": optimizer}, world_size=1, registry=registry)
        assert config.optimizer.params == {}
    model = torch.nn.Linear(3, 1)
    before = model.weight.detach().clone()
    engine = Engine(model, {"train_batch_size": 2, "optimizer": {"type": "Plain"}}, registry=registry)
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    assert torch.allclose(model.weight.detach(), before - 0.5 * 2 * torch.ones(1, 3))  # SGD: w - lr * grad (2 rows)
    with pytest.raises(ConfigError, match=r"optimizer\.params: plugin optimizer:Plain .* takes no config .*'lr'"):
        DsplugConfig({"train_batch_size": 2, "optimizer": {"type": "Plain", "params": {"lr": 1}}}, world_size=1,
                     registry=registry)
