"""Plugin discovery and the cheap commands import no torch.

``dsplug --help``, ``--version``, ``list`` and ``config check`` load every installed plugin's entry
point and the schemas of its config sections. Importing torch takes seconds; discovery must stay
cheap however many plugins are installed. So every entry-point module (dsplug's and contrib/'s)
and every schema module is imported alone in a fresh interpreter, and each command runs in one:
torch must not be in ``sys.modules`` afterwards. A failure prints the import chain that pulled
torch in.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CONTRIB = sorted(p for p in (REPO / "contrib").iterdir() if (p / "pyproject.toml").exists())

#: runs ``{body}``; exit 99 and the stack of the first ``import torch`` if torch got imported
PROBE = '''
import sys, traceback
first = []

class TorchSpy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not first:
            first.append("".join(traceback.format_stack()[:-1]))
        return None

sys.meta_path.insert(0, TorchSpy())
code = 0
{body}
if "torch" in sys.modules:
    sys.stderr.write("torch was imported here:\\n" + (first[0] if first else "?"))
    sys.exit(99)
sys.exit(code)
'''


def probe(body: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in CONTRIB] +
                                                      [os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", PROBE.format(body=body), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def entry_point_modules():
    """(distribution folder, entry point, module) of every ``dsplug`` entry point in this repository."""
    out = []
    for folder in [REPO, *CONTRIB]:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        for name, value in project.get("entry-points", {}).get("dsplug", {}).items():
            out.append(pytest.param(value.split(":")[0], id=f"{folder.name}:{name}"))
    return out


@pytest.mark.parametrize("module", entry_point_modules())
def test_entry_point_module_imports_no_torch(module):
    result = probe(f"import importlib; importlib.import_module({module!r})")
    assert result.returncode == 0, f"importing the entry point {module} imports torch:\n{result.stderr}"


def schema_modules():
    """Modules defining the schema of a plugin's config (every installed plugin, nested schemas too)."""
    script = (
        "import json, attrs, typing\n"
        "from dsplug.registry import get_registry\n"
        "seen, todo = set(), [p.spec.schema for p in get_registry().all() if p.spec.schema is not None]\n"
        "while todo:\n"
        "    cls = todo.pop()\n"
        "    if cls in seen: continue\n"
        "    seen.add(cls)\n"
        "    for a in attrs.fields(cls):\n"
        "        for t in (a.type, *typing.get_args(a.type)):\n"
        "            if attrs.has(t): todo.append(t)\n"
        "print(json.dumps(sorted({c.__module__ for c in seen})))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_schema_module_imports_no_torch():
    modules = schema_modules()
    assert "dsplug.plugins.compression.config" in modules and "dsplug.plugins.zero.config" in modules
    offenders = {}
    for module in modules:
        result = probe(f"import importlib; importlib.import_module({module!r})")
        if result.returncode != 0:
            offenders[module] = result.stderr
    assert not offenders, "schema modules that import torch:\n" + "\n".join(f"{m}:\n{e}" for m, e in offenders.items())


def test_discovery_calls_every_hook_without_torch():
    result = probe("from dsplug.registry import get_registry\nregistry = get_registry()\n"
                   "assert not registry.broken, registry.broken\nprint(len(registry.all()))")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 40


#: a config with many plugin-owned sections, so that `config check` parses each one's schema
FULL_CONFIG = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "activation_checkpointing": {"partition_activations": False},
    "flops_profiler": {"enabled": True, "profile_step": 2}, "comms_logger": {"enabled": True},
    "tensorboard": {"enabled": False}, "csv_monitor": {"enabled": True, "output_path": "/tmp/x"},
    "aio": {"block_size": 1048576, "single_submit": "false"},
    "compression_training": {
        "weight_quantization": {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                                "different_groups": {"g1": {"params": {"start_bits": 8, "target_bits": 8},
                                                            "modules": ["*"]}}},
        "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "snip_momentum", "block_pattern": "4x1",
                                                 "schedule_offset_end": 10, "schedule_offset_stride": 2,
                                                 "schedule_offset": 2},
                           "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["*"]}}}},
    "data_efficiency": {"enabled": False}, "progressive_layer_drop": {"enabled": False},
}


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["list"], ["list", "--json"], ["config", "check"],
                                  ["train", "--help"], ["launch", "--help"]],
                         ids=lambda argv: " ".join(argv))
def test_cheap_commands_import_no_torch(argv, tmp_path):
    if argv == ["config", "check"]:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(FULL_CONFIG))
        argv = argv + [str(path), "--world-size", "2"]
    result = probe("from dsplug.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
                   "except SystemExit as exit:\n    code = exit.code\n", *argv)
    assert result.returncode == 0, f"dsplug {' '.join(argv)}: exit {result.returncode}\n{result.stderr}"
    if argv[0] == "config":
        assert result.stdout.strip().endswith("valid for world size 2")
